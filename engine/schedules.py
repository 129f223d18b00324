"""Pipeline schedules as data: for every pipeline rank, its ordered list of actions.

Generators build compute-only schedules; `engine.passes` lowers them (adds communication);
the validator, the simulator and the runtime all read the same `Schedule` value.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from engine.actions import Action, ActionKind, parse_actions

__all__ = [
    "SCHEDULES",
    "Schedule",
    "format_schedule",
    "gpipe",
    "inference",
    "make_schedule",
    "one_f_one_b",
    "parse_schedule",
]


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
        return tuple(s for s, r in enumerate(self.placement) if r == rank)

    def __str__(self) -> str:
        return format_schedule(self)


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


def _one_f_one_b_row(rank: int, num_ranks: int, micro_batches: int) -> list[Action]:
    warmup = min(num_ranks - rank - 1, micro_batches)
    row = [Action(rank, ActionKind.F, k) for k in range(warmup)]
    for k in range(micro_batches - warmup):
        row += [Action(rank, ActionKind.F, warmup + k), Action(rank, ActionKind.B, k)]
    row += [Action(rank, ActionKind.B, k) for k in range(micro_batches - warmup, micro_batches)]
    return row


def one_f_one_b(num_ranks: int, micro_batches: int) -> Schedule:
    """PipeDream-Flush: warm-up forwards, then alternate F and B, then the cool-down backwards.

    Rank r keeps at most `min(P - r, m)` micro-batches in flight instead of GPipe's m, for the
    same bubble.
    """
    _check_sizes(num_ranks, micro_batches)
    rows = [_one_f_one_b_row(r, num_ranks, micro_batches) for r in range(num_ranks)]
    return _one_stage_per_rank("1f1b", rows, micro_batches)


def inference(num_ranks: int, micro_batches: int) -> Schedule:
    """Forwards only, in micro-batch order: what `eval_step` runs."""
    _check_sizes(num_ranks, micro_batches)
    rows = [[Action(r, ActionKind.F, k) for k in range(micro_batches)] for r in range(num_ranks)]
    return _one_stage_per_rank("inference", rows, micro_batches)


SCHEDULES: dict[str, Callable[..., Schedule]] = {"gpipe": gpipe, "1f1b": one_f_one_b}
"""Schedule generators by the name a config or the CLI uses."""


def make_schedule(name: str, *, num_ranks: int, micro_batches: int) -> Schedule:
    """Build a registered schedule by name (the config's and the CLI's entry point)."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}: choose one of {', '.join(SCHEDULES)}")
    _check_sizes(num_ranks, micro_batches)
    return SCHEDULES[name](num_ranks, micro_batches)


def parse_schedule(
    rows: Sequence[str],
    *,
    micro_batches: int,
    placement: Sequence[int] | None = None,
    name: str = "custom",
) -> Schedule:
    """A schedule from one text row per rank (`"0F0 0F1 0B0 0B1"`); stage s on rank s by default.

    It is marked lowered when any row holds a send or receive.
    """
    parsed = tuple(tuple(parse_actions(row)) for row in rows)
    places = tuple(range(len(rows)) if placement is None else placement)
    return Schedule(
        name=name,
        num_ranks=len(rows),
        num_stages=len(places),
        micro_batches=micro_batches,
        placement=places,
        rows=parsed,
        lowered=any(not a.is_compute for row in parsed for a in row),
    )


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
