"""The measured timeline of a run as a Chrome/Perfetto trace: one track per rank.

Every rank keeps its actions' (start, end) per step on the host's monotonic clock, which all
processes of a host share; at the end the slices are gathered to rank 0 and written, so the
trace can be laid next to `meshpipe schedule --trace` for the same schedule.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch.distributed as dist

from engine.runtime.step_stats import StepStats
from engine.schedule.plots import chrome_trace

__all__ = ["TraceRecorder"]


class TraceRecorder:
    """Collects this rank's action slices step by step (keeps state, hence a class)."""

    def __init__(self) -> None:
        self._origin = time.perf_counter()
        self._slices: list[tuple[str, float, float]] = []

    def record(self, step: int, started: float, stats: StepStats) -> None:
        offset = started - self._origin
        for timing in stats.timings:
            name = str(timing.action)
            self._slices.append((name, offset + timing.start, offset + timing.end))
        for name, start, end in stats.phases:
            self._slices.append((name, offset + start, offset + end))

    def write(self, path: str | Path, *, rank: int, world_size: int) -> None:
        """Gather every rank's slices to rank 0, which writes the trace file."""
        mine = (self._origin, self._slices)
        gathered: list[tuple[float, list[tuple[str, float, float]]]] = [mine]
        if world_size > 1:
            gathered = [mine] * world_size
            dist.all_gather_object(gathered, mine)
        if rank != 0:
            return
        base = min(origin for origin, _ in gathered)
        tracks = [
            [(name, origin - base + s, origin - base + e) for name, s, e in slices]
            for origin, slices in gathered
        ]
        chrome_trace(tracks, path)
