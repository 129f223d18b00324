"""Where stages live: the loop placement (stage s on rank s mod P) and the V placement.

With v stages per rank, the chunk c of rank r is one stage. Loop places chunk c of rank r at
stage c·P + r (Megatron's interleaving: the model runs down the ranks v times). V places the
even chunks the same way and mirrors the odd ones, so the model runs down the ranks and back
up (with two chunks, rank r holds stages r and 2P − 1 − r): the first and last stages share
rank 0, so the loss needs no hop back, and stages P − 1 and P share rank P − 1, whose hand-off
stays in memory.
"""

from __future__ import annotations

from dataclasses import replace

from engine.schedule.actions import Action
from engine.schedule.schedule import Schedule

__all__ = ["PLACEMENTS", "chunk_stage", "placement_name", "placement_of", "with_placement"]

PLACEMENTS = ("loop", "v")
"""The stage placements a run can ask for (`--placement`)."""


def _check(kind: str) -> None:
    if kind not in PLACEMENTS:
        raise ValueError(f"unknown placement {kind!r}: choose one of {', '.join(PLACEMENTS)}")


def chunk_stage(kind: str, *, rank: int, chunk: int, num_ranks: int) -> int:
    """The stage that chunk `chunk` of `rank` is under placement `kind`."""
    _check(kind)
    mirrored = kind == "v" and chunk % 2 == 1
    return chunk * num_ranks + (num_ranks - 1 - rank if mirrored else rank)


def placement_of(kind: str, num_ranks: int, stages_per_rank: int) -> tuple[int, ...]:
    """The rank of every stage under placement `kind` (`Schedule.placement`)."""
    ranks = [0] * (num_ranks * stages_per_rank)
    for rank in range(num_ranks):
        for chunk in range(stages_per_rank):
            ranks[chunk_stage(kind, rank=rank, chunk=chunk, num_ranks=num_ranks)] = rank
    return tuple(ranks)


def placement_name(schedule: Schedule) -> str | None:
    """`loop` or `v` when the schedule's placement is one of them (one stage per rank is both:
    `loop`), else None (a hand-written placement)."""
    per_rank, rest = divmod(schedule.num_stages, schedule.num_ranks)
    if rest:
        return None
    for kind in PLACEMENTS:
        if schedule.placement == placement_of(kind, schedule.num_ranks, per_rank):
            return kind
    return None


def with_placement(schedule: Schedule, kind: str) -> Schedule:
    """The same rows with every chunk's stage renamed to its stage under placement `kind`: each
    rank runs its chunks in the same order, now holding the stages `kind` gives it."""
    current = placement_name(schedule)
    if current is None:
        raise ValueError(
            f"schedule {schedule.name!r} has placement {schedule.placement}, neither loop nor v: "
            "a hand-written placement cannot be changed by name; edit the schedule file"
        )
    p = schedule.num_ranks
    rename = {
        chunk_stage(current, rank=r, chunk=c, num_ranks=p): chunk_stage(
            kind, rank=r, chunk=c, num_ranks=p
        )
        for r in range(p)
        for c in range(schedule.num_stages // p)
    }
    rows = tuple(
        tuple(Action(rename[a.stage], a.kind, a.micro_batch) for a in row) for row in schedule.rows
    )
    placement = placement_of(kind, p, schedule.num_stages // p)
    return replace(schedule, rows=rows, placement=placement)
