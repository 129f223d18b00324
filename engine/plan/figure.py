"""A plan in one picture: its simulated timeline above, each rank's predicted peak memory
against the device's below."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engine.plan.request import PlanRequest, Prediction
from engine.schedule.plots import KIND_COLOURS, draw_timeline

__all__ = ["plan_figure", "plot_plan"]


def plot_plan(request: PlanRequest, plan: Prediction, path: str | Path) -> None:
    """Write `plan_figure` as a PNG."""
    fig = plan_figure(request, plan)
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=110)
    plt.close(fig)


def plan_figure(request: PlanRequest, plan: Prediction) -> Any:
    """The plan's timeline above its ranks' peaks, as a matplotlib figure; a plan with many
    micro-batches shows the simulated sample the search extended from (`engine.plan.search`),
    each rank ending with its data-parallel reduction and optimizer update
    (`Prediction.tails`), so the picture spans the whole step."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError as error:
        raise ValueError("--plot needs matplotlib: pip install 'meshpipe[plot]'") from error
    ranks = len(plan.rank_peaks)
    fig, (top, bottom) = plt.subplots(
        2, 1, figsize=(11, 0.35 * ranks + 5), height_ratios=(max(ranks, 2), 3)
    )
    _timeline(top, request, plan, Patch)
    _memory(bottom, request, plan)
    fig.tight_layout()
    return fig


_TAIL_COLOUR = "#8C8C8C"


def _timeline(ax: Any, request: PlanRequest, plan: Prediction, patch: Any) -> None:
    """The simulated step, each rank's tail after its last action, kinds named beside."""
    result = plan.simulated
    assert result is not None, "the best plans are simulated"
    ends = [max((t.end for t in row), default=0.0) for row in result.timeline]
    tails = plan.tails or (0.0,) * len(ends)
    kinds = draw_timeline(
        ax,
        result,
        labels=len(ends) * result.steps <= 200,
        end=max(end + tail for end, tail in zip(ends, tails, strict=True)),
    )
    ax.barh(range(len(ends)), tails, left=ends, color=_TAIL_COLOUR, linewidth=0)
    ax.set_xlabel("seconds")
    shown = len({t.action.micro_batch for row in result.timeline for t in row})
    sample = "" if shown == plan.candidate.micro_batches else f" (first {shown} micro-batches)"
    ax.set_title(
        f"{request.model}: {plan.candidate.describe()}{sample}\n"
        f"step {plan.step_time:.3g} s, bubble {plan.bubble:.1%}, MFU {plan.mfu:.1%}"
    )
    ax.legend(
        [patch(color=KIND_COLOURS[k]) for k in kinds] + [patch(color=_TAIL_COLOUR)],
        [k.value for k in kinds] + ["dp reduction,\noptimizer"],
        loc="upper left",
        bbox_to_anchor=(1.0, 1.0),
        fontsize=8,
        frameon=False,
    )


def _memory(ax: Any, request: PlanRequest, plan: Prediction) -> None:
    gib = 2**30
    ranks = range(len(plan.rank_peaks))
    ax.bar(ranks, [p / gib for p in plan.rank_peaks], color="#4C72B0")
    ax.set_xticks(ranks[:: -(-len(ranks) // 32)])
    ax.axhline(request.device_memory / gib, color="#C44E52", linestyle="--", label="device")
    ax.set_xlabel("pipeline rank")
    ax.set_ylabel("peak GiB")
    ax.legend(fontsize=8)
