"""Pictures of a schedule: timeline plots (Gantt charts) and Chrome/Perfetto traces."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

from engine.schedule.actions import ActionKind
from engine.schedule.simulate import SimResult, TimedAction

__all__ = [
    "KIND_COLOURS",
    "TRACKS",
    "TraceSlice",
    "chrome_trace",
    "draw_timeline",
    "plot_timeline",
    "timeline_figure",
]

KIND_COLOURS = {
    ActionKind.F: "#4C72B0",
    ActionKind.B: "#DD8452",
    ActionKind.I: "#C44E52",
    ActionKind.W: "#55A868",
}


def plot_timeline(result: SimResult, path: str | Path, *, title: str) -> None:
    """Draw a Gantt chart (`timeline_figure`) into an image file."""
    fig = timeline_figure(result, title=title)
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=120)
    plt.close(fig)


def timeline_figure(result: SimResult, *, title: str) -> Any:
    """A Gantt chart as a matplotlib figure: a row per rank, a colour per action kind, each
    action labelled by its micro-batch and, when ranks hold several stages (interleaved
    schedules), by the stage's chunk on its rank (`F3·c1`); the legend lists the kinds drawn."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError as error:
        raise ValueError("plotting needs matplotlib: pip install 'meshpipe[plot]'") from error
    ranks = len(result.timeline)
    fig, ax = plt.subplots(figsize=(max(6.0, result.step_time * 0.35), 0.6 * ranks + 1.2))
    kinds = draw_timeline(ax, result)
    ax.set_title(f"{title} — bubble {result.bubble:.1%}")
    ax.legend(
        [Patch(color=KIND_COLOURS[kind]) for kind in kinds],
        [kind.value for kind in kinds],
        loc="upper center",
        bbox_to_anchor=(0.5, -0.35 / max(1, ranks) - 0.15),
        ncols=4,
        fontsize=8,
        frameon=False,
    )
    fig.tight_layout()
    return fig


def draw_timeline(
    ax: Any, result: SimResult, *, labels: bool = True, end: float | None = None
) -> list[ActionKind]:
    """Draw the Gantt chart's bars on matplotlib axes, from 0 to `end` (the step's), each
    labelled where its label fits (unless `labels` is off); the action kinds drawn, for a
    legend."""
    ranks = len(result.timeline)
    chunks = _chunks(result)
    drawn = [(r, timed) for r, row in enumerate(result.timeline) for timed in row if _drawn(timed)]
    span = end if end is not None else result.step_time
    ax.set_xlim(0, span)
    per_char = _char_width(ax, span)
    for rank, timed in drawn:
        _draw(ax, rank, timed, chunks, per_char, labels)
    ax.set_yticks(range(ranks), [f"rank {r}" for r in range(ranks)])
    ax.set_ylim(ranks - 0.5, -0.5)
    ax.set_xlabel("time")
    return [kind for kind in KIND_COLOURS if any(t.action.kind == kind for _, t in drawn)]


_CHAR_INCHES = 0.055
"""About the width of one character of the labels (7 pt) on the page."""


def _char_width(ax: Any, span: float) -> float:
    """A label character's width in the axes' time units: a bar narrower than its label
    goes unlabelled rather than printing over its neighbours."""
    inches = ax.figure.get_figwidth() * ax.get_position().width
    return span * _CHAR_INCHES / inches if inches > 0 and span > 0 else 0.0


def _drawn(timed: TimedAction) -> bool:
    """Compute actions that took time; communication and empty actions are not drawn."""
    return timed.action.kind in KIND_COLOURS and timed.end > timed.start


def _chunks(result: SimResult) -> dict[int, int] | None:
    """Each stage's chunk, its place among the stages its rank holds; None when every rank
    holds one stage (nothing to tell apart)."""
    chunk: dict[int, int] = {}
    for row in result.timeline:
        stages = sorted({timed.action.stage for timed in row if _drawn(timed)})
        chunk.update({stage: i for i, stage in enumerate(stages)})
    return chunk if any(chunk.values()) else None


def _draw(
    ax: Any,
    rank: int,
    timed: TimedAction,
    chunks: dict[int, int] | None,
    per_char: float,
    labels: bool,
) -> None:
    """One action's bar, edged in white where it is wide enough to keep a gap from the
    next; a narrow one unedged and not antialiased (white edges, or thin bars blended into
    the background, would paint a busy rank pale)."""
    action = timed.action
    width = timed.end - timed.start
    wide = width >= 2 * per_char
    ax.barh(
        rank,
        width,
        left=timed.start,
        color=KIND_COLOURS[action.kind],
        edgecolor="white",
        linewidth=1.0 if wide else 0.0,
        antialiased=wide,
    )
    if not labels:
        return
    kind, micro_batch = action.kind.value, action.micro_batch
    if chunks is not None:
        chunk = chunks[action.stage]
        long, short = f"{kind}{micro_batch}·c{chunk}", f"{micro_batch}·c{chunk}"
    else:
        long, short = f"{action.stage}{kind}{micro_batch}", f"{micro_batch}"
    label = next((text for text in (long, short) if (len(text) + 0.5) * per_char <= width), None)
    if label is not None:
        middle = timed.start + width / 2
        ax.text(middle, rank, label, ha="center", va="center", fontsize=7, color="white")


TRACKS = ("compute", "communication")
"""A rank's tracks in a trace: its actions and phases, and the collectives that overlap them."""


class TraceSlice(NamedTuple):
    """One slice of a rank's timeline in a trace."""

    name: str
    start: float
    end: float
    step: int = 0
    """The training step it belongs to (a simulated schedule is one step, 0)."""
    track: str = "compute"
    """One of `TRACKS`: communication that runs beside compute (the dp all-reduce overlaps
    the last backward) gets a track of its own, so each track's slices nest."""


def chrome_trace(
    timelines: Sequence[Sequence[TraceSlice]],
    path: str | Path,
    *,
    unit_s: float = 1.0,
    process: str = "meshpipe",
) -> None:
    """Write Chrome/Perfetto trace JSON: a track per rank (tid = rank), below it a track for its
    communication when it has any (tid = ranks + rank), one slice per `TraceSlice`, each
    carrying its step in `args`.

    `unit_s` converts the times to seconds (1 for measured runs; any scale for simulations).
    """
    ranks = len(timelines)
    slices: list[dict[str, object]] = []
    tids = set(range(ranks))
    for rank, timeline in enumerate(timelines):
        for piece in map(TraceSlice._make, timeline):
            tid = rank + ranks * TRACKS.index(piece.track)
            tids.add(tid)
            slices.append(
                {
                    "name": piece.name,
                    "cat": piece.name.lstrip("0123456789").rstrip("0123456789"),
                    "ph": "X",
                    "pid": 0,
                    "tid": tid,
                    "ts": piece.start * unit_s * 1e6,
                    "dur": (piece.end - piece.start) * unit_s * 1e6,
                    "args": {"step": piece.step},
                }
            )
    process_name = {"name": "process_name", "ph": "M", "pid": 0, "args": {"name": process}}
    tracks = [event for tid in sorted(tids) for event in _track_names(tid, ranks)]
    events = [process_name, *tracks, *slices]
    Path(path).write_text(json.dumps({"traceEvents": events}), encoding="utf-8")


def _track_names(tid: int, ranks: int) -> list[dict[str, object]]:
    """The metadata naming a track and keeping each rank's tracks together, in rank order."""
    track, rank = divmod(tid, ranks)
    name = f"rank {rank}" if track == 0 else f"rank {rank} {TRACKS[track]}"
    return [
        {"name": "thread_name", "ph": "M", "pid": 0, "tid": tid, "args": {"name": name}},
        {
            "name": "thread_sort_index",
            "ph": "M",
            "pid": 0,
            "tid": tid,
            "args": {"sort_index": rank * len(TRACKS) + track},
        },
    ]
