"""The plans a search shows, replayed exactly (`estimate_memory`, as `meshpipe memory` prints
them): their distinct stages traced ahead, then each plan replayed in a worker where the
machine has the cores, handed the traces it reads (the workers were forked before they were
made). A 405b plan's replay is about a third of a second, and a search replays three or
more.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from engine.memory.estimate import MemoryConfig, estimate_memory, trace_requests
from engine.memory.trace_store import TraceRequest, cached_trace, hold_traces, trace_ahead
from engine.memory.traces import StageTrace
from engine.memory.workers import in_workers
from engine.plan.request import PlanRequest, Prediction, Progress, layout_fields, reporting

__all__ = ["memory_config", "replayed"]

_Peaks = tuple[tuple[int, ...], tuple[int, ...]]


def memory_config(request: PlanRequest, plan: Prediction) -> MemoryConfig:
    """The plan as `meshpipe memory --plan` reads it."""
    fields = layout_fields(request, plan.candidate, plan.boundaries)
    return MemoryConfig.of(device=request.device, **fields)


def replayed(
    request: PlanRequest, plans: Sequence[Prediction], progress: Progress | None = None
) -> list[Prediction]:
    """Each plan with its exact replay's stage and rank peaks, in order."""
    configs = [memory_config(request, plan) for plan in plans]
    wanted = [trace_requests(config) for config in configs]
    trace_ahead((r for requests in wanted for r in requests), reporting(progress, "tracing stages"))
    handed = [
        (config, {r: cached_trace(*r) for r in requests})
        for config, requests in zip(configs, wanted, strict=True)
    ]
    return [
        replace(plan, stage_peaks=stage_peaks, rank_peaks=rank_peaks)
        for plan, (stage_peaks, rank_peaks) in zip(plans, in_workers(_peaks, handed), strict=True)
    ]


def _peaks(item: tuple[MemoryConfig, dict[TraceRequest, StageTrace]]) -> _Peaks:
    """One plan's replay (in a worker): its stage peaks and rank peaks."""
    config, traces = item
    hold_traces(traces)
    report = estimate_memory(config)
    return tuple(s.peak for s in report.stages), tuple(report.rank_peaks)
