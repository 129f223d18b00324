"""A plan in one picture: its simulated timeline above, each rank's predicted peak memory
against the device's below."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engine.plan.request import PlanRequest, Prediction
from engine.schedule.plots import KIND_COLOURS, draw_timeline

__all__ = ["plot_plan"]


def plot_plan(request: PlanRequest, plan: Prediction, path: str | Path) -> None:
    """Write the PNG; a plan with many micro-batches shows the simulated sample of
    4 per pipeline rank the search extended from (`engine.plan.search`)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError as error:
        raise ValueError("--plot needs matplotlib: pip install 'meshpipe[plot]'") from error
    result = plan.simulated
    assert result is not None, "the best plans are simulated"
    ranks = len(plan.rank_peaks)
    fig, (top, bottom) = plt.subplots(
        2, 1, figsize=(11, 0.35 * ranks + 5), height_ratios=(max(ranks, 2), 3)
    )
    kinds = draw_timeline(top, result, labels=ranks * result.steps <= 200)
    top.set_xlabel("seconds")
    shown = len({t.action.micro_batch for row in result.timeline for t in row})
    sample = "" if shown == plan.candidate.micro_batches else f" (first {shown} micro-batches)"
    top.set_title(
        f"{request.model}: {plan.candidate.describe()}{sample}\n"
        f"step {plan.step_time:.3g} s, bubble {plan.bubble:.1%}, MFU {plan.mfu:.1%}"
    )
    top.legend(
        [Patch(color=KIND_COLOURS[k]) for k in kinds],
        [k.value for k in kinds],
        loc="upper right",
        fontsize=8,
    )
    _memory(bottom, request, plan)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _memory(ax: Any, request: PlanRequest, plan: Prediction) -> None:
    gib = 2**30
    ranks = range(len(plan.rank_peaks))
    ax.bar(ranks, [p / gib for p in plan.rank_peaks], color="#4C72B0")
    ax.axhline(request.device_memory / gib, color="#C44E52", linestyle="--", label="device")
    ax.set_xlabel("pipeline rank")
    ax.set_ylabel("peak GiB")
    ax.legend(fontsize=8)
