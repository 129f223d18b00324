"""Schedule generators: GPipe, 1F1B, interleaved, looped BFS and the zero-bubble family.

Each builds a compute-only `Schedule` (F, B, I, W actions per rank); `make_schedule` picks one by
the name a config or the CLI uses, the V-placed ones (`engine.schedule.v_schedules`) included.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from engine.schedule.actions import Action, ActionKind
from engine.schedule.placement import PLACEMENTS, placement_name, placement_of, with_placement
from engine.schedule.schedule import Schedule
from engine.schedule.v_schedules import V_SCHEDULES

__all__ = [
    "SCHEDULES",
    "VIRTUAL_SCHEDULES",
    "gpipe",
    "inference",
    "interleaved_1f1b",
    "looped_bfs",
    "make_schedule",
    "one_f_one_b",
    "own_placement",
    "placed",
    "zb_drain",
    "zb_h1",
    "zb_h2",
]


def _check_sizes(num_ranks: int, micro_batches: int) -> None:
    if num_ranks < 1:
        raise ValueError(f"num_ranks={num_ranks}: a pipeline needs at least 1 rank")
    if micro_batches < 1:
        raise ValueError(
            f"micro_batches={micro_batches}: a step needs at least 1 micro-batch "
            "(use micro_batches >= num_ranks to keep the bubble small)"
        )


def _one_stage_per_rank(name: str, rows: list[list[Action]], micro_batches: int) -> Schedule:
    num_ranks = len(rows)
    return Schedule(
        name=name,
        num_ranks=num_ranks,
        num_stages=num_ranks,
        micro_batches=micro_batches,
        placement=tuple(range(num_ranks)),
        rows=tuple(tuple(row) for row in rows),
    )


def gpipe(num_ranks: int, micro_batches: int) -> Schedule:
    """All forwards, then all backwards, both in micro-batch order (stage s on rank s).

    Backwards run in ascending order, not the reverse, so that every stage accumulates its
    gradients in the same order as a single-process reference and matches it bit for bit.
    """
    _check_sizes(num_ranks, micro_batches)
    rows = [
        [Action(r, ActionKind.F, k) for k in range(micro_batches)]
        + [Action(r, ActionKind.B, k) for k in range(micro_batches)]
        for r in range(num_ranks)
    ]
    return _one_stage_per_rank("gpipe", rows, micro_batches)


def one_f_one_b(num_ranks: int, micro_batches: int) -> Schedule:
    """PipeDream-Flush: warm-up forwards, then alternate F and B, then the cool-down backwards.

    Rank r keeps at most `min(P - r, m)` micro-batches in flight instead of GPipe's m, for the
    same bubble.
    """
    _check_sizes(num_ranks, micro_batches)
    rows = [
        _one_f_one_b_row(r, micro_batches, min(num_ranks - r - 1, micro_batches))
        for r in range(num_ranks)
    ]
    return _one_stage_per_rank("1f1b", rows, micro_batches)


def inference(num_ranks: int, micro_batches: int) -> Schedule:
    """Forwards only, in micro-batch order: what `eval_step` runs."""
    _check_sizes(num_ranks, micro_batches)
    rows = [[Action(r, ActionKind.F, k) for k in range(micro_batches)] for r in range(num_ranks)]
    return _one_stage_per_rank("inference", rows, micro_batches)


def _virtual(
    name: str, rows: list[list[Action]], micro_batches: int, stages_per_rank: int
) -> Schedule:
    """Stage s on rank s mod P (Megatron's loop placement)."""
    num_ranks = len(rows)
    num_stages = num_ranks * stages_per_rank
    return Schedule(
        name=name,
        num_ranks=num_ranks,
        num_stages=num_stages,
        micro_batches=micro_batches,
        placement=tuple(s % num_ranks for s in range(num_stages)),
        rows=tuple(tuple(row) for row in rows),
    )


def _check_virtual(name: str, num_ranks: int, micro_batches: int, stages_per_rank: int) -> None:
    _check_sizes(num_ranks, micro_batches)
    if stages_per_rank < 1:
        raise ValueError(f"{name}: stages_per_rank={stages_per_rank} must be at least 1")


def interleaved_1f1b(num_ranks: int, micro_batches: int, stages_per_rank: int = 2) -> Schedule:
    """Megatron's virtual pipeline: v stages per rank, 1F1B over (stage, micro-batch) units.

    Units run in groups of P micro-batches, stage chunk by chunk (forwards ascending through
    the chunks, backwards descending), which divides the bubble by v: (P-1)/(v·m+P-1).
    Requires m to be a multiple of P so every group is full.
    """
    p, m, v = num_ranks, micro_batches, stages_per_rank
    _check_virtual("interleaved_1f1b", p, m, v)
    if m % p:
        raise ValueError(
            f"interleaved_1f1b needs the micro-batches to be a multiple of the pipeline ranks "
            f"(m={m}, P={p}): use m={p * max(1, m // p)} or m={p * (m // p + 1)}"
        )

    def unit(i: int, backward: bool) -> tuple[int, int]:
        group, pos = divmod(i, p * v)
        chunk, offset = divmod(pos, p)
        return (v - 1 - chunk if backward else chunk), group * p + offset

    rows = []
    for r in range(p):
        total = m * v
        warmup = total if m == p else min(total, (p - r - 1) * 2 + (v - 1) * p)
        fwd = [
            Action(c * p + r, ActionKind.F, k) for c, k in (unit(i, False) for i in range(total))
        ]
        bwd = [Action(c * p + r, ActionKind.B, k) for c, k in (unit(i, True) for i in range(total))]
        row = fwd[:warmup]
        for i in range(total - warmup):
            row += [fwd[warmup + i], bwd[i]]
        rows.append(row + bwd[total - warmup :])
    return _virtual("interleaved_1f1b", rows, m, v)


def looped_bfs(num_ranks: int, micro_batches: int, stages_per_rank: int = 2) -> Schedule:
    """Breadth-first over loop-placed stages: every micro-batch through one chunk, then the next.

    GPipe per chunk; its in-flight activations grow with m·v, its bubble shrinks like
    interleaved's when sends are asynchronous.
    """
    p, m, v = num_ranks, micro_batches, stages_per_rank
    _check_virtual("looped_bfs", p, m, v)
    rows = [
        [Action(c * p + r, ActionKind.F, k) for c in range(v) for k in range(m)]
        + [Action(c * p + r, ActionKind.B, k) for c in reversed(range(v)) for k in range(m)]
        for r in range(p)
    ]
    return _virtual("looped_bfs", rows, m, v)


def _zero_bubble_row(rank: int, micro_batches: int, warmup: int, w_lag: int) -> list[Action]:
    """1F1B with the backward split: F/I pairs, each W `w_lag` pairs late; the late W's fill
    the cool-down, where the rank would otherwise wait for the next input gradient.

    With no lag (the first stage, whose input gradient nobody waits for) each I would be
    followed at once by its W: the row runs a fused B instead, which costs less than I + W.
    """
    F, I, W = ActionKind.F, ActionKind.I, ActionKind.W  # noqa: E741 - the paper's names
    m, warmup = micro_batches, min(warmup, micro_batches)
    if w_lag == 0:
        return _one_f_one_b_row(rank, m, warmup)
    row, next_w = [Action(rank, F, k) for k in range(warmup)], 0
    for j in range(m - warmup):
        row += [Action(rank, F, warmup + j), Action(rank, I, j)]
        if j >= w_lag:
            row.append(Action(rank, W, next_w))
            next_w += 1
    for j in range(m - warmup, m):
        row.append(Action(rank, I, j))
        if next_w <= j:
            row.append(Action(rank, W, next_w))
            next_w += 1
    return row + [Action(rank, W, k) for k in range(next_w, m)]


def _one_f_one_b_row(
    rank: int, micro_batches: int, warmup: int, *, split: frozenset[int] = frozenset()
) -> list[Action]:
    """`warmup` forwards, then F/backward pairs, then the remaining backwards; micro-batches
    in `split` run I instead of B, and their W's come last, in micro-batch order."""
    m = micro_batches

    def backward(k: int) -> Action:
        return Action(rank, ActionKind.I if k in split else ActionKind.B, k)

    row = [Action(rank, ActionKind.F, k) for k in range(warmup)]
    for j in range(m - warmup):
        row += [Action(rank, ActionKind.F, warmup + j), backward(j)]
    row += [backward(j) for j in range(m - warmup, m)]
    return row + [Action(rank, ActionKind.W, k) for k in sorted(split)]


def zb_h1(num_ranks: int, micro_batches: int) -> Schedule:
    """Zero Bubble ZB-H1 (Qi et al. 2024): 1F1B's warm-up, rank r defers r weight gradients.

    Same peak activations as 1F1B (P micro-batches on every rank); bubble
    (P-1)(T_F + T_I - T_W) instead of 1F1B's (P-1)(T_F + T_I + T_W).
    """
    _check_sizes(num_ranks, micro_batches)
    p = num_ranks
    rows = [_zero_bubble_row(r, micro_batches, p - 1 - r, r) for r in range(p)]
    return _one_stage_per_rank("zb_h1", rows, micro_batches)


def zb_h2(num_ranks: int, micro_batches: int) -> Schedule:
    """Zero Bubble ZB-H2: twice the warm-up forwards and weight gradients deferred 2r pairs.

    Peak activations 2P-1 on the first rank; with T_F = T_I = T_W and steps that follow each
    other without a barrier, no bubble at all once m >= 2P.
    """
    _check_sizes(num_ranks, micro_batches)
    p = num_ranks
    rows = [_zero_bubble_row(r, micro_batches, 2 * (p - 1 - r), 2 * r) for r in range(p)]
    return _one_stage_per_rank("zb_h2", rows, micro_batches)


def zb_drain(num_ranks: int, micro_batches: int) -> Schedule:
    """ZB-H2's warm-up with fused backwards, split only where a W fills the drain.

    Made for steps that follow each other without a barrier (no clipping, no fp16, no
    non-finite guard). Between a rank's last I of one step and the next step's first
    activation, the ranks before it run their last backwards, the first stage's optimizer step
    and the new forwards: about r·(F + B) on rank r. Only the last min(m, 3r) micro-batches of
    rank r split their backward; their W's fill that gap. Every other backward is fused (B),
    which costs less than I + W, and gradients still accumulate in micro-batch order. With a
    few ranks (P = 2) it has the shortest period; with P ≥ 4 ZB-H2 fills the middle ranks
    better (ask `meshpipe schedule` with profiled costs).
    """
    _check_sizes(num_ranks, micro_batches)
    p, m = num_ranks, micro_batches
    rows = [
        _one_f_one_b_row(
            r, m, min(m, 2 * (p - 1 - r)), split=frozenset(range(m - min(m, 3 * r), m))
        )
        for r in range(p)
    ]
    return _one_stage_per_rank("zb_drain", rows, micro_batches)


SCHEDULES: dict[str, Callable[..., Schedule]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved_1f1b": interleaved_1f1b,
    "looped_bfs": looped_bfs,
    "zb_h1": zb_h1,
    "zb_h2": zb_h2,
    "zb_drain": zb_drain,
    **V_SCHEDULES,
}
"""Schedule generators by the name a config or the CLI uses."""

VIRTUAL_SCHEDULES = frozenset({"interleaved_1f1b", "looped_bfs"})
"""Generators that take `stages_per_rank` (v > 1 stages per rank)."""

_ONE_STAGE_EQUIVALENT = {"interleaved_1f1b": "1f1b", "looped_bfs": "gpipe"}
"""What a virtual schedule does with one stage per rank (at its bubble, more in flight)."""


def make_schedule(
    name: str,
    *,
    num_ranks: int,
    micro_batches: int,
    stages_per_rank: int = 1,
    placement: str | None = None,
) -> Schedule:
    """Build a registered schedule by name (the config's and the CLI's entry point); with
    `placement` (`loop` or `v`), its chunks are placed that way (None: the schedule's own)."""
    if name == "inference":
        raise ValueError(
            "schedule 'inference' runs forwards only: every engine's eval_step runs it "
            f"(engine.inference builds it); a training run takes one of {', '.join(SCHEDULES)}"
        )
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}: choose one of {', '.join(SCHEDULES)}")
    _check_sizes(num_ranks, micro_batches)
    schedule = _generate(name, num_ranks, micro_batches, stages_per_rank)
    return schedule if placement is None else placed(schedule, placement)


@functools.lru_cache(maxsize=4)
def _generate(name: str, num_ranks: int, micro_batches: int, stages_per_rank: int) -> Schedule:
    """The generator's schedule; the last few are kept (a schedule is immutable): a planned
    layout's config checks and its replay build the same one in turn, at 100k actions."""
    if name in V_SCHEDULES:
        if stages_per_rank != 2:
            raise ValueError(
                f"schedule {name!r} holds two stages per rank in a V, not {stages_per_rank}: "
                "give --stages-per-rank 2"
            )
        return SCHEDULES[name](num_ranks, micro_batches)
    if name in VIRTUAL_SCHEDULES:
        if stages_per_rank == 1:
            plain = _ONE_STAGE_EQUIVALENT[name]
            raise ValueError(
                f"schedule {name!r} with 1 stage per rank is {plain} with more micro-batches in "
                f"flight: give --stages-per-rank 2 or more, or use --schedule {plain}"
            )
        return SCHEDULES[name](num_ranks, micro_batches, stages_per_rank)
    if stages_per_rank != 1:
        raise ValueError(
            f"schedule {name!r} runs one stage per rank, not {stages_per_rank}: use "
            f"{' or '.join(sorted(VIRTUAL_SCHEDULES | set(V_SCHEDULES)))} for several stages "
            "per rank"
        )
    return SCHEDULES[name](num_ranks, micro_batches)


def own_placement(name: str, num_ranks: int, stages_per_rank: int) -> tuple[int, ...]:
    """The placement `make_schedule(name, ...)` gives its stages, without building its rows:
    the planner screens thousands of layouts by their placement and counts alone."""
    kind = "v" if name in V_SCHEDULES else "loop"
    return placement_of(kind, num_ranks, stages_per_rank)


def placed(schedule: Schedule, placement: str) -> Schedule:
    """`schedule` under `placement`; an error naming the fix where its order cannot run there
    (the dry run that follows in `check_fits` finds a deadlock)."""
    if placement not in PLACEMENTS:
        raise ValueError(f"unknown placement {placement!r}: choose one of {', '.join(PLACEMENTS)}")
    own = placement_name(schedule)
    if own == placement or schedule.num_stages == schedule.num_ranks:
        return schedule
    if schedule.name in V_SCHEDULES or schedule.name == "interleaved_1f1b":
        raise ValueError(
            f"schedule {schedule.name!r} orders its actions for the {own} placement and cannot "
            f"run under --placement {placement}: drop --placement, or use looped_bfs (either "
            f"placement) or {', '.join(V_SCHEDULES)} (v)"
        )
    return with_placement(schedule, placement)
