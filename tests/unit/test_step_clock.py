"""Action times come from the clock that sees the device's work: host on CPU, events on CUDA."""

from __future__ import annotations

import time

import pytest
import torch

from engine.runtime.interpreter import execute
from engine.runtime.step_clock import CudaClock, HostClock, step_clock
from engine.schedule.actions import Action, ActionKind
from engine.schedule.schedule import Schedule


class _FakeGpu:
    """A device clock the test advances: kernels 'take' time without the host waiting."""

    def __init__(self) -> None:
        self.now_ms = 1000.0
        self.synchronized = 0


class _FakeEvent:
    gpu: _FakeGpu

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing, "elapsed_time needs timing events"
        self.at_ms: float | None = None

    def record(self) -> None:
        self.at_ms = self.gpu.now_ms

    def synchronize(self) -> None:
        self.gpu.synchronized += 1

    def elapsed_time(self, other: _FakeEvent) -> float:
        assert self.at_ms is not None and other.at_ms is not None
        return other.at_ms - self.at_ms


@pytest.fixture
def gpu(monkeypatch: pytest.MonkeyPatch) -> _FakeGpu:
    fake = _FakeGpu()
    _FakeEvent.gpu = fake
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    return fake


def _schedule() -> Schedule:
    row = (Action(0, ActionKind.F, 0), Action(0, ActionKind.B, 0))
    return Schedule(
        name="one", num_ranks=1, num_stages=1, micro_batches=1, placement=(0,), rows=(row,)
    )


def test_the_device_picks_the_clock() -> None:
    assert isinstance(step_clock(torch.device("cpu")), HostClock)
    assert isinstance(step_clock(torch.device("cuda")), CudaClock)


def test_on_cuda_an_action_lasts_as_long_as_the_gpu_worked(gpu: _FakeGpu) -> None:
    """The host returns at once from queueing kernels; the events see 30 and 50 ms of work."""
    work_ms = {ActionKind.F: 30.0, ActionKind.B: 50.0}

    def queue(action: Action) -> None:
        gpu.now_ms += work_ms[action.kind]

    handlers = {ActionKind.F: queue, ActionKind.B: queue}
    timings = execute(_schedule(), 0, handlers, clock=CudaClock())
    spans = [t.end - t.start for t in timings]
    assert spans == pytest.approx([0.030, 0.050])
    assert timings[1].start == pytest.approx(timings[0].end)
    assert gpu.synchronized == 1  # once, after the step's last action


def test_on_the_host_clock_an_action_lasts_as_long_as_its_handler() -> None:
    spans = {ActionKind.F: 0.002, ActionKind.B: 0.004}

    def sleep(action: Action) -> None:
        time.sleep(spans[action.kind])

    timings = execute(_schedule(), 0, {ActionKind.F: sleep, ActionKind.B: sleep})
    assert timings[0].start == 0.0
    for timing, wanted in zip(timings, spans.values(), strict=True):
        assert timing.end - timing.start >= wanted
