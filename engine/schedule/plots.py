"""Pictures of a schedule: timeline plots (Gantt charts) and Chrome/Perfetto traces."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from engine.schedule.actions import ActionKind
from engine.schedule.simulate import SimResult, TimedAction

__all__ = ["KIND_COLOURS", "chrome_trace", "plot_timeline"]

KIND_COLOURS = {
    ActionKind.F: "#4C72B0",
    ActionKind.B: "#DD8452",
    ActionKind.I: "#C44E52",
    ActionKind.W: "#55A868",
}


def plot_timeline(result: SimResult, path: str | Path, *, title: str) -> None:
    """Draw a Gantt chart: a row per rank, a colour per action kind, micro-batch numbers."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError as error:
        raise ValueError("plotting needs matplotlib: pip install 'meshpipe[plot]'") from error
    ranks = len(result.timeline)
    fig, ax = plt.subplots(figsize=(max(6.0, result.step_time * 0.35), 0.6 * ranks + 1.2))
    for rank, row in enumerate(result.timeline):
        for timed in row:
            _draw(ax, rank, timed)
    ax.set_yticks(range(ranks), [f"rank {r}" for r in range(ranks)])
    ax.invert_yaxis()
    ax.set_xlim(0, result.step_time)
    ax.set_xlabel("time")
    ax.set_title(f"{title} — bubble {result.bubble:.1%}")
    handles = [Patch(color=c) for c in KIND_COLOURS.values()]
    ax.legend(
        handles,
        [k.value for k in KIND_COLOURS],
        loc="upper center",
        bbox_to_anchor=(0.5, -0.35 / max(1, ranks) - 0.15),
        ncols=4,
        fontsize=8,
        frameon=False,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _draw(ax: Any, rank: int, timed: TimedAction) -> None:
    action = timed.action
    if action.kind not in KIND_COLOURS or timed.end <= timed.start:
        return
    width = timed.end - timed.start
    ax.barh(rank, width, left=timed.start, color=KIND_COLOURS[action.kind], edgecolor="white")
    label = (
        f"{action.micro_batch}"
        if width < 1.5
        else f"{action.stage}{action.kind.value}{action.micro_batch}"
    )
    ax.text(
        timed.start + width / 2, rank, label, ha="center", va="center", fontsize=7, color="white"
    )


def chrome_trace(
    timelines: Sequence[Sequence[tuple[str, float, float]]],
    path: str | Path,
    *,
    unit_s: float = 1.0,
    process: str = "meshpipe",
) -> None:
    """Write Chrome/Perfetto trace JSON: one track per rank, one slice per (name, start, end).

    `unit_s` converts the times to seconds (1 for measured runs; any scale for simulations).
    """
    events: list[dict[str, object]] = [
        {"name": "process_name", "ph": "M", "pid": 0, "args": {"name": process}}
    ]
    for rank, slices in enumerate(timelines):
        events.append(
            {
                "name": "thread_name",
                "ph": "M",
                "pid": 0,
                "tid": rank,
                "args": {"name": f"rank {rank}"},
            }
        )
        for name, start, end in slices:
            events.append(
                {
                    "name": name,
                    "cat": name.lstrip("0123456789").rstrip("0123456789"),
                    "ph": "X",
                    "pid": 0,
                    "tid": rank,
                    "ts": start * unit_s * 1e6,
                    "dur": (end - start) * unit_s * 1e6,
                }
            )
    Path(path).write_text(json.dumps({"traceEvents": events}), encoding="utf-8")
