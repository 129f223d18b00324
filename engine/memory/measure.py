"""Measuring a layout's memory by running its step: the check on `estimate_memory`.

`measure_memory` builds each stage for real (on the CPU, or on a GPU with `device="cuda"`),
replays every micro-batch of its schedule row, then awaits the sends and runs a real AdamW step,
all under the same `MemoryTracker`; the allocator's own peak comes alongside. With `fake=True`
it replays every micro-batch on fake tensors instead: what `estimate_memory` composes from one.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, replace

import torch

from engine.config import require
from engine.memory.estimate import (
    Layout,
    MemoryConfig,
    MemoryReport,
    StageMemory,
    resolve,
    stage_memory,
)
from engine.memory.fake_world import StageGrid, stage_grid
from engine.memory.rank_states import RankStates, fsdp_resizes
from engine.memory.replay import (
    StageRun,
    build_stage,
    fake_parameters,
    local_edges,
    rank_events,
    sends_released,
)
from engine.memory.states import optimizer_bytes, param_info, tail_peak
from engine.memory.tracker import MemoryTracker, fake_device, round_up
from engine.schedule.actions import Action, split_units
from models import LayerStack, build_layers

__all__ = ["MEASURE_LIMIT", "activation_peaks", "check_measurable", "measure_memory"]

MEASURE_LIMIT = 2**31
"""Measuring builds the model for real: layouts whose states exceed 2 GiB are refused."""


@dataclass(frozen=True, kw_only=True)
class _Measured:
    step_peak: int
    kept: int
    weight_copies: int
    weights: int
    gradients: int
    optimizer: int | None
    allocator: int | None


def _storages(tensors: Iterable[torch.Tensor], block: int) -> int:
    unique = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in tensors}
    return sum(round_up(n, block) for n in unique.values())


def _module(config: MemoryConfig, layout: Layout, stage: int, fake: bool) -> LayerStack:
    if fake:
        module = build_stage(layout.stage_specs(stage))
        fake_parameters(module)
        return module
    return build_layers(
        layout.specs, layout.partition.layers_of(stage), seed=0, device=config.device
    )


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """Silence the profiler's start/stop lines, which its C++ side writes to fd 2."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def _allocator_peak(device: str, work: Callable[[], None]) -> int | None:
    """The allocator's peak above its level before `work`: CUDA's statistics, or the CPU
    allocator's events from the profiler (None where it records none)."""
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        work()
        return torch.cuda.max_memory_allocated() - base
    activities = [torch.profiler.ProfilerActivity.CPU]
    with (
        _quiet_stderr(),
        torch.profiler.profile(activities=activities, profile_memory=True) as prof,
    ):
        work()
    try:
        events = prof.profiler.kineto_results.events()  # type: ignore[union-attr]
        deltas = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
    except AttributeError:
        return None
    live = peak = 0
    for _, delta in deltas:
        live += delta
        peak = max(peak, live)
    return peak


def _runs(
    config: MemoryConfig,
    layout: Layout,
    stages: Sequence[int],
    actions: Sequence[Action],
    fake: bool,
    grid: StageGrid,
) -> dict[int, StageRun]:
    """The stages' replays (split over the grid's tp ranks); each splits the micro-batches
    its row runs I for."""
    last, split = layout.partition.num_stages - 1, split_units(actions)
    return {
        s: StageRun(
            _module(config, layout, s, fake),
            layout.stage_specs(s),
            first=s == 0,
            last=s == last,
            split=frozenset(k for stage, k in split if stage == s),
            shape=layout.shape(config, s),
            local_in=local_edges(layout.schedule, s)[0],
            local_out=local_edges(layout.schedule, s)[1],
            tp_mesh=grid.tp_mesh,
        )
        for s in stages
    }


class _Step:
    """One measured step of some stages of a rank: every micro-batch of their row inside the
    stages' step scopes (the step's weight copies, as the engine runs its schedule), then the
    step's end (real runs reduce the gradients over the grid's replicas as the engine does,
    await the sends and step AdamW under the tracker)."""

    def __init__(
        self,
        config: MemoryConfig,
        layout: Layout,
        stages: Sequence[int],
        fake: bool,
        grid: StageGrid,
    ):
        row = layout.schedule.rows[layout.schedule.rank_of(stages[0])]
        self.actions = [a for a in row if a.is_compute and a.stage in stages]
        self.releases = sends_released(layout.schedule, stages)
        self.events = rank_events(layout.schedule, stages, self.releases)
        self.runs = _runs(config, layout, stages, self.actions, fake, grid)
        self.states = (
            None
            if fake
            else RankStates(
                [run.stage for run in self.runs.values()],
                zero=config.engine.zero,
                reshard=[config.engine.reshard_of(s) for s in stages],
                precision=config.engine.precision,
                spec=config.optimizer,
                grid=grid,
            )
        )
        self.tracker = MemoryTracker(block=layout.block)
        self.block = layout.block
        self.kept = self.weight_copies = self.cached = self.held = self.live_end = 0

    def begin(self, *, gradients: bool = False) -> None:
        """The step's start; `gradients`: every gradient allocated now, zero, so that a
        tracker entered afterwards sees the step's activations and not them."""
        for run in self.runs.values():
            run.begin()
            for param in run.stage.module.parameters() if gradients else ():
                param.grad = torch.zeros_like(param)
        if self.states is not None:
            self.states.begin()

    def __call__(self) -> None:
        self.begin()
        self.run()

    def run(self) -> None:
        """Every action of the row inside the stages' step scopes, then the step's end."""
        first = self.actions[0]
        with contextlib.ExitStack() as scope:
            for run in self.runs.values():
                scope.enter_context(run.stage.step_scope())
            copies, gathered = self.tracker.weight_copies, self._gathered()
            net = self.tracker.measure(lambda: self.runs[first.stage].act(first)).net
            self.weight_copies = self.tracker.weight_copies - copies
            self.kept = net - self.weight_copies - (self._gathered() - gathered)
            for action in self.events[1:]:
                if action.is_compute:
                    self.runs[action.stage].act(action)
                for sent in self.releases.get(action, ()):
                    self.runs[sent.stage].release_sent(sent.micro_batch)
            self.held = sum(run.held_bytes(self.block) for run in self.runs.values())
            self.live_end = self.tracker.live
            self.cached = self.tracker.weight_copies
            if self.states is not None:
                self.states.gradients_final()
        for run in self.runs.values():
            run.finish()
        if self.states is not None:
            self.states.step()

    def _gathered(self) -> int:
        return 0 if self.states is None else self.states.gathered()

    def modules(self) -> list[torch.nn.Module]:
        return [run.stage.module for run in self.runs.values()]


def _run_step(
    config: MemoryConfig, layout: Layout, stages: Sequence[int], fake: bool, grid: StageGrid
) -> _Measured:
    """Measure one step; fake runs (no optimizer without values) add the tail
    `estimate_memory` adds, from the replay's end."""
    step = _Step(config, layout, stages, fake, grid)
    with step.tracker, fsdp_resizes(step.tracker):
        allocator = None if fake else _allocator_peak(config.device, step)
        if fake:
            step()
    block = layout.block
    if step.states is None:
        params = [p for m in step.modules() for p in param_info(m)]
        tail = tail_peak(
            params, live_end=step.live_end, held=step.held, cached=step.cached, states=layout.states
        )
        weights = [p for m in step.modules() for p in m.parameters()]
        return _Measured(
            step_peak=max(step.tracker.peak, tail),
            kept=step.kept,
            weight_copies=step.weight_copies,
            weights=_storages(weights, block),
            gradients=_storages([p.grad for p in weights if p.grad is not None], block),
            optimizer=None,
            allocator=None,
        )
    states = step.states
    kept = {t.untyped_storage()._cdata for t in states.weights()}
    return _Measured(
        step_peak=step.tracker.peak,
        kept=step.kept,
        weight_copies=step.weight_copies,
        weights=_storages(states.weights(), block),
        gradients=sum(round_up(n, block) for n in states.gradients.values()),
        optimizer=_storages(
            [t for t in states.optimizer_states() if t.untyped_storage()._cdata not in kept],
            block,
        ),
        allocator=allocator,
    )


def check_measurable(config: MemoryConfig) -> None:
    """Refuse what one process here cannot run: a missing GPU, a model too large."""
    layout = resolve(config)
    if config.device == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            "--measure --device cuda needs a GPU and this machine has none: use --device cpu"
        )
    states = sum(
        optimizer_bytes(layout.params([s]), layout.states)
        for s in range(layout.partition.num_stages)
    )
    if 2 * states > MEASURE_LIMIT:
        raise ValueError(
            f"--measure builds {config.model.name} for real here, about "
            f"{2 * states / 2**30:.1f} GiB of weights and optimizer states (limit "
            f"{MEASURE_LIMIT / 2**30:.0f} GiB): measure a small model such as gpt-tiny or "
            "llama-tiny"
        )


def measure_memory(config: MemoryConfig, *, fake: bool = False) -> MemoryReport:
    """Run every stage's part of the step (and each multi-stage rank's whole row) and report
    what the tracker saw; `fake` replays on fake tensors, without memory, for any model."""
    layout = resolve(config)
    if not fake:
        check_measurable(config)
    parallel = config.parallel
    require(
        not fake or not config.engine.zero,
        "a fake-replayed run steps an unsharded optimizer: replay with --zero 0 (measure "
        "ZeRO for real, or estimate it)",
    )
    context = fake_device(cuda=config.device == "cuda") if fake else contextlib.nullcontext()
    zero3 = config.engine.zero == 3
    grid = (
        stage_grid(1, 1)
        if fake
        else stage_grid(parallel.dp, parallel.tp, device=config.device, fsdp=zero3)
    )
    with context, grid as rank:
        measured = {
            s: _run_step(config, layout, [s], fake, rank)
            for s in range(layout.partition.num_stages)
        }
        rows = [layout.schedule.stages_of(r) for r in range(parallel.pp)]
        steps = [
            measured[r[0]] if len(r) == 1 else _run_step(config, layout, r, fake, rank)
            for r in rows
        ]
    stages = tuple(_stage(config, layout, s, m) for s, m in measured.items())
    rank_peaks = tuple(
        step.step_peak + sum(stages[s].weights + stages[s].optimizer for s in row)
        for step, row in zip(steps, rows, strict=True)
    )
    return MemoryReport(
        config=config,
        partition=layout.partition,
        stages=stages,
        rank_peaks=rank_peaks,
        source="fake replay" if fake else f"measured on {config.device}",
        allocator_peaks=None if fake else tuple(m.allocator for m in measured.values()),
    )


def activation_peaks(config: MemoryConfig) -> tuple[int, ...]:
    """Each rank's activation peak, measured: its whole row run for real under the tracker,
    every gradient allocated before the tracker starts and no optimizer step, so the peak
    holds what the schedule decides (stashes, W inputs, received and held sent tensors,
    losses, a backward's transients) and not the states every schedule holds alike."""
    check_measurable(config)
    layout = resolve(config)
    parallel = config.parallel
    peaks = []
    zero3 = config.engine.zero == 3
    with stage_grid(parallel.dp, parallel.tp, device=config.device, fsdp=zero3) as grid:
        for rank in range(parallel.pp):
            step = _Step(config, layout, layout.schedule.stages_of(rank), False, grid)
            step.states = None
            step.begin(gradients=True)
            with step.tracker:
                step.run()
            peaks.append(step.tracker.peak)
    return tuple(peaks)


def _stage(config: MemoryConfig, layout: Layout, stage: int, measured: _Measured) -> StageMemory:
    predicted = stage_memory(
        config,
        layout,
        stage,
        kept=measured.kept,
        weight_copies=measured.weight_copies,
        step_peak=measured.step_peak,
    )
    return replace(
        predicted,
        weights=measured.weights,
        gradients=measured.gradients,
        optimizer=predicted.optimizer if measured.optimizer is None else measured.optimizer,
    )
