"""A schedule as text, one line per rank (`rank 0: 0F0 0F1 0B0 …`): what `meshpipe schedule`
prints, what a runtime or simulator error shows around the failing action, and what tests and
users write by hand to run a schedule no generator makes.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.schedule.actions import Action, parse_actions
from engine.schedule.generators import Schedule

__all__ = ["format_schedule", "parse_schedule"]


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
