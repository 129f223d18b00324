"""`meshpipe plan`'s printed result: the best plans as a table, their per-stage peaks, why the
others lost, and what the predictions were priced with."""

from __future__ import annotations

from collections.abc import Sequence

from engine.config import format_size
from engine.plan import LOSSES, PlanRequest, PlanResult, Prediction

__all__ = ["format_result"]


def _ranges(stages: Sequence[int]) -> str:
    runs: list[list[int]] = []
    for s in stages:
        if runs and s == runs[-1][-1] + 1:
            runs[-1].append(s)
        else:
            runs.append([s])
    return ",".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)


def _layout(plan: Prediction) -> str:
    c = plan.candidate
    text = c.describe().split(" recompute")[0]
    if c.recompute:
        every = len(c.recompute) == c.num_stages
        text += " recompute " + ("all" if every else "stages " + _ranges(c.recompute))
        if c.recompute_every:
            text += f" every:{c.recompute_every}"
    return text


def format_result(result: PlanResult, elapsed: float) -> str:
    """The best plans as a table, their per-rank peaks, and why the others lost."""
    r = result.request
    lost = ", ".join(f"{result.losses[k]} {k}" for k in LOSSES)
    lines = [
        f"meshpipe plan: {r.model} on {r.devices} devices of {format_size(r.device_memory)}, "
        f"global batch {r.global_batch} × {r.seq_len} tokens",
        f"searched {result.considered} layouts in {elapsed:.1f} s; the others lost: {lost}",
        "",
        f"{'#':<2} {'layout':<62} {'step':>9} {'tokens/s':>10} {'bubble':>7} {'MFU':>6} "
        f"{'peak':>10}",
    ]
    for i, plan in enumerate(result.plans, 1):
        lines.append(
            f"{i:<2} {_layout(plan):<62} {plan.step_time:>8.3g}s {plan.tokens_per_s:>10,.0f} "
            f"{plan.bubble:>7.1%} {plan.mfu:>6.1%} {format_size(max(plan.rank_peaks)):>10}"
        )
    lines.append("")
    for i, plan in enumerate(result.plans, 1):
        peaks = ", ".join(format_size(p) for p in plan.stage_peaks)
        lines.append(f"plan {i} peak per stage: {peaks}")
    lines.append(_priced(r))
    return "\n".join(lines)


def _priced(r: PlanRequest) -> str:
    """What the predictions were priced with: the user reads which rates were assumed and
    which were measured here."""
    hw = r.hardware
    compute = (
        f"layers timed on this CPU, MFU against its {_flops(hw.device_flops)} GEMM peak"
        if r.measured is not None
        else f"{hw.device_flops / 1e12:g} TFLOP/s × {hw.compute_efficiency:g} per device"
    )
    return (
        f"priced with: {compute}; links {_rate(hw.link_bandwidth)} within a node, "
        f"{_rate(hw.inter_node_bandwidth)} across, {_duration(hw.latency)} latency; "
        f"memory {_rate(hw.memory_bandwidth)}"
    )


def _flops(per_s: float) -> str:
    return f"{per_s / 1e12:.3g} TFLOP/s" if per_s >= 1e12 else f"{per_s / 1e9:.3g} GFLOP/s"


def _rate(bytes_per_s: float) -> str:
    if bytes_per_s >= 1e12:
        return f"{bytes_per_s / 1e12:.3g} TB/s"
    return f"{bytes_per_s / 1e9:.3g} GB/s"


def _duration(seconds: float) -> str:
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.3g} ms"
    return f"{seconds * 1e6:.3g} µs"
