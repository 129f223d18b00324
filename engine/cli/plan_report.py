"""`meshpipe plan`'s printed result: the best plans as a table, their per-stage peaks, why the
others lost, and what the predictions were priced with."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from engine.config import format_size
from engine.memory.trace_cache import Writes, trace_folder
from engine.plan import LOSSES, PlanRequest, PlanResult, Prediction

__all__ = ["Traced", "format_result"]

Traced = dict[str, tuple[int, float]]
"""What a search traced on fake tensors, by kind ("layers", "stages"): how many traces and
the seconds they took (`meshpipe plan`'s progress reports)."""


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


def format_result(
    result: PlanResult,
    elapsed: float,
    traced: Mapping[str, tuple[int, float]] | None = None,
    kept: Writes | None = None,
) -> str:
    """The best plans as a table, their per-rank peaks, and why the others lost; with
    `traced`, how much of the search was tracing that a later one reads from disk (`kept`: the
    search's writes of traces to the disk cache)."""
    r = result.request
    lost = ", ".join(f"{result.losses[k]} {k}" for k in LOSSES)
    lines = [
        f"meshpipe plan: {r.model} on {r.devices} devices of {format_size(r.device_memory)}, "
        f"global batch {r.global_batch} × {r.seq_len} tokens",
        f"searched {result.considered} layouts in {elapsed:.1f} s; the others lost: {lost}",
        *_tracing(traced or {}, kept or Writes()),
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


def _tracing(traced: Mapping[str, tuple[int, float]], kept: Writes) -> list[str]:
    """A first search of a model traces its layers (and the plans shown their stages) on fake
    tensors, most of its time on a small machine; a later one reads what is kept."""
    if not traced:
        return []
    seconds = sum(s for _, s in traced.values())
    made = " and ".join(f"{n} {kind.removesuffix('s')} traces" for kind, (n, _) in traced.items())
    return [f"{seconds:.1f} s of it making {made} on fake tensors, once: {_kept(kept)}"]


def _kept(kept: Writes) -> str:
    """Where the traces went: a write that failed keeps nothing (the trace cache then only
    costs speed), and saying "kept" there would be wrong."""
    folder = trace_folder()
    if folder is None:
        return "not kept (MESHPIPE_TRACE_CACHE=off)"
    if kept.failed == 0:
        return f"kept in {folder} for later searches"
    some = "" if kept.failed == kept.tried else f"{kept.failed} of {kept.tried} "
    return f"{some}not kept ({folder}: {kept.reason})"


def _priced(r: PlanRequest) -> str:
    """What the predictions were priced with: the user reads which rates were assumed and
    which were measured here."""
    hw = r.hardware
    compute = (
        f"layers timed on this CPU, MFU against its {_flops(hw.device_flops)} GEMM peak"
        if r.measured is not None
        else f"{hw.device_flops / 1e12:g} TFLOP/s × {hw.compute_efficiency:g} per device"
    )
    shards = ""
    if (hw.reduce_scatter_factor, hw.all_gather_factor) != (1.0, 1.0):
        shards = (
            f", reduce-scatter {hw.reduce_scatter_factor:.2g}× and all-gather "
            f"{hw.all_gather_factor:.2g}× a ring's"
        )
    cores = ""
    if 0 < hw.host_cores < r.devices:
        cores = f"; the {r.devices} ranks sharing this host's {hw.host_cores} cores"
    return (
        f"priced with: {compute}; links {_rate(hw.link_bandwidth)} within a node, "
        f"{_rate(hw.inter_node_bandwidth)} across, {_duration(hw.latency)} latency{shards}; "
        f"memory {_rate(hw.memory_bandwidth)}{cores}"
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
