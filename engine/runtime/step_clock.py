"""Where a step's action times come from: the host's clock, or the GPU's own.

On a CPU the host runs the kernels, so its monotonic clock times the work. On CUDA the host
only queues kernels and moves on: its clock would time the launches (microseconds), and the
measured bubble would count as idle what the GPU spent computing. There every mark is a CUDA
event on the current stream, read once the step's work has finished, and placed on the host's
clock at the first mark (exact for durations; for aligning ranks in a trace, the first mark's
queueing delay is the error).
"""

from __future__ import annotations

import time
from typing import Protocol

import torch

__all__ = ["CudaClock", "HostClock", "StepClock", "step_clock"]


class StepClock(Protocol):
    def mark(self) -> int:
        """Note this point of the step (in the order the host reaches it); its index."""
        ...

    def seconds(self) -> list[float]:
        """Every mark's time on the host's `perf_counter` clock, in mark order (waits for the
        device where marks are device events)."""
        ...


class HostClock:
    """Marks on the host's monotonic clock."""

    def __init__(self) -> None:
        self._times: list[float] = []

    def mark(self) -> int:
        self._times.append(time.perf_counter())
        return len(self._times) - 1

    def seconds(self) -> list[float]:
        return list(self._times)


class CudaClock:
    """Marks as CUDA events on the current stream: when the GPU got there, not the host."""

    def __init__(self) -> None:
        self._events: list[torch.cuda.Event] = []
        self._host_first = 0.0

    def mark(self) -> int:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        if not self._events:
            self._host_first = time.perf_counter()
        self._events.append(event)
        return len(self._events) - 1

    def seconds(self) -> list[float]:
        if not self._events:
            return []
        self._events[-1].synchronize()
        first = self._events[0]
        return [self._host_first + first.elapsed_time(event) / 1e3 for event in self._events]


def step_clock(device: torch.device) -> StepClock:
    """The clock that times this device's work."""
    return CudaClock() if device.type == "cuda" else HostClock()
