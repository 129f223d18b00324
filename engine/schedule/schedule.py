"""The `Schedule` value: for every pipeline rank, its ordered list of actions, and its text grid.

Generators (`engine.schedule.generators`) build compute-only schedules; `engine.schedule.passes`
lowers them (adds communication); the validator, the simulator and the runtime all read the same
value. `format_schedule` is its text form, one line per rank (`rank 0: 0F0 0F1 0B0 …`): what
`meshpipe schedule` prints and what a runtime or simulator error shows around the failing action.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

from engine.schedule.actions import Action

__all__ = ["Schedule", "format_schedule", "stages_by_rank"]


@dataclass(frozen=True, kw_only=True)
class Schedule:
    """Per-rank action lists plus where each stage lives."""

    name: str
    """Generator that made it (`gpipe`, `1f1b`, …) or `custom`."""
    num_ranks: int
    """Pipeline ranks (P)."""
    num_stages: int
    """Stages (S = P·v with v stages per rank)."""
    micro_batches: int
    """Micro-batches per step (m)."""
    placement: tuple[int, ...]
    """Rank of each stage: `placement[s]`."""
    rows: tuple[tuple[Action, ...], ...]
    """`rows[r]`: rank r's actions in execution order."""
    lowered: bool = False
    """True once `engine.passes.add_communication` has added the sends and receives."""

    def __post_init__(self) -> None:
        # Shape only: the content (orders, counts, matching sends) is `engine.validate`'s job,
        # so that a broken schedule can still be built and then explained in full.
        if self.num_ranks < 1 or self.num_stages < 1 or self.micro_batches < 1:
            raise ValueError(
                f"schedule needs num_ranks, num_stages, micro_batches >= 1, got "
                f"{self.num_ranks}, {self.num_stages}, {self.micro_batches}"
            )
        if len(self.rows) != self.num_ranks:
            raise ValueError(
                f"schedule has {len(self.rows)} rows for {self.num_ranks} ranks: give one per rank"
            )
        if len(self.placement) != self.num_stages:
            raise ValueError(
                f"placement {self.placement} has {len(self.placement)} entries for "
                f"{self.num_stages} stages: give the rank of every stage"
            )
        bad = [r for r in self.placement if not 0 <= r < self.num_ranks]
        if bad:
            raise ValueError(
                f"placement {self.placement} names ranks {bad} outside 0..{self.num_ranks - 1}"
            )

    def rank_of(self, stage: int) -> int:
        return self.placement[stage]

    def stages_of(self, rank: int) -> tuple[int, ...]:
        return self._stages_by_rank[rank] if 0 <= rank < self.num_ranks else ()

    def __hash__(self) -> int:
        return self._hash

    def __getstate__(self) -> dict[str, object]:
        """Pickled without the cached hash: str hashes differ between processes."""
        return {key: value for key, value in self.__dict__.items() if key != "_hash"}

    @functools.cached_property
    def _hash(self) -> int:
        """Hashed once: schedules key the caches of the runtime, the replay and the planner,
        and hashing tens of thousands of actions on every lookup cost the planner seconds."""
        fields = (self.name, self.num_ranks, self.num_stages, self.micro_batches)
        return hash((*fields, self.placement, self.rows, self.lowered))

    @functools.cached_property
    def _stages_by_rank(self) -> tuple[tuple[int, ...], ...]:
        """Each rank's stages, once: the planner asks for them hundreds of thousands of times."""
        return stages_by_rank(self.placement, self.num_ranks)

    def __str__(self) -> str:
        return format_schedule(self)


def stages_by_rank(placement: tuple[int, ...], num_ranks: int) -> tuple[tuple[int, ...], ...]:
    """Each rank's stages in order (`Schedule.stages_of`; the planner's placements without
    rows, `engine.plan.context.Pipeline`, and `arrays.rank_stages`)."""
    mine: list[list[int]] = [[] for _ in range(num_ranks)]
    for stage, rank in enumerate(placement):
        mine[rank].append(stage)
    return tuple(map(tuple, mine))


def _window_tokens(row: Sequence[Action], lo: int, hi: int, marked: int | None) -> list[str]:
    tokens = [f">>{a}<<" if i == marked else str(a) for i, a in enumerate(row) if lo <= i < hi]
    if lo > 0 and row:
        tokens.insert(0, "…")
    if hi < len(row):
        tokens.append("…")
    return tokens


def format_schedule(
    schedule: Schedule, *, around: tuple[int, int] | None = None, width: int = 12
) -> str:
    """One line per rank, `rank 0: 0F0 0F1 0B0 …`.

    With `around=(rank, index)` only `width` positions around that action are shown on every
    rank and the action itself is marked `>>0B1<<`: what a runtime error shows.
    """
    label = len(str(schedule.num_ranks - 1))
    if around is None:
        lo, hi, focus = 0, max((len(row) for row in schedule.rows), default=0), None
    else:
        focus_rank, index = around
        if not 0 <= focus_rank < schedule.num_ranks:
            raise ValueError(f"around={around}: rank must be in 0..{schedule.num_ranks - 1}")
        if width < 1:
            raise ValueError(f"width={width}: show at least 1 action")
        lo = max(0, index - width // 2)
        hi, focus = lo + width, around
    lines = []
    for rank, row in enumerate(schedule.rows):
        marked = focus[1] if focus is not None and focus[0] == rank else None
        tokens = _window_tokens(row, lo, hi, marked)
        lines.append(f"rank {rank:>{label}}: {' '.join(tokens)}".rstrip())
    return "\n".join(lines)
