"""The measured timeline of a run as a Chrome/Perfetto trace: one track per rank, and one
for its collectives that run beside compute (the dp all-reduce, the tied-weight sum).

Every rank keeps its actions' (start, end) per step on the host's monotonic clock, which all
processes of a host share; at the end the slices are gathered to rank 0 and written, so the
trace can be laid next to `meshpipe schedule --trace` for the same schedule. Every slice
carries its step.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch.distributed as dist

from engine.runtime.step_stats import StepStats
from engine.schedule.plots import TraceSlice, chrome_trace

__all__ = ["COMMUNICATION_PHASES", "TraceRecorder"]

COMMUNICATION_PHASES = frozenset({"dp all-reduce", "tied sum"})
"""The step phases (`StepStats.phases`) that are collectives: the dp all-reduce starts during
the stage's last backward, so on the compute track it would cut across it."""


class TraceRecorder:
    """Collects this rank's action slices step by step (keeps state, hence a class)."""

    def __init__(self) -> None:
        self._origin = time.perf_counter()
        self._slices: list[TraceSlice] = []

    def record(self, step: int, started: float, stats: StepStats) -> None:
        offset = started - self._origin
        for timing in stats.timings:
            name = str(timing.action)
            self._slices.append(
                TraceSlice(name, offset + timing.start, offset + timing.end, step=step)
            )
        for name, start, end in stats.phases:
            track = "communication" if name in COMMUNICATION_PHASES else "compute"
            self._slices.append(
                TraceSlice(name, offset + start, offset + end, step=step, track=track)
            )

    def write(self, path: str | Path, *, rank: int, world_size: int) -> None:
        """Gather every rank's slices to rank 0, which writes the trace file."""
        mine = (self._origin, self._slices)
        gathered: list[tuple[float, list[TraceSlice]]] = [mine]
        if world_size > 1:
            gathered = [mine] * world_size
            dist.all_gather_object(gathered, mine)
        if rank != 0:
            return
        base = min(origin for origin, _ in gathered)
        tracks = [
            [
                piece._replace(start=origin - base + piece.start, end=origin - base + piece.end)
                for piece in slices
            ]
            for origin, slices in gathered
        ]
        chrome_trace(tracks, path)
