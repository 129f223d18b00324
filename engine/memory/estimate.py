"""Per-stage memory of a pipeline layout, before anything is allocated.

Weights and optimizer states follow from the parameter shapes. Everything else a step allocates
(activations, autocast's weight copies, gradients, receive and send buffers) comes from replaying
the schedule: each stage runs its rank's actions in order through the runtime's own
`PipelineStage`, on fake tensors, under a `MemoryTracker`. Micro-batches are alike, so one traced
micro-batch per distinct stage is composed along the schedule instead of replaying all of them:
that equals a full replay exactly (tested), and a 70B layout takes seconds. After the schedule
come the DP all-reduce's flat buffers and the optimizer's temporaries (`memory_states`).
`measure_memory` runs the same replay and a real optimizer step on real tensors.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from engine.config import require
from engine.memory.memory_config import DEVICE_MODELS, MemoryConfig
from engine.memory.memory_partition import replayed_fitting_partition
from engine.memory.replay import (
    StageShape,
    backward_styles,
    in_flight,
    local_edges,
    rank_events,
    sends_released,
    stage_actions,
)
from engine.memory.sharding import fsdp_step_peak, sharded_states, sharded_step_peak
from engine.memory.states import (
    ParamInfo,
    StateLayout,
    optimizer_bytes,
    replica_sync_bytes,
    stage_params,
    tail_peak,
)
from engine.memory.trace_store import TraceRequest, cached_trace
from engine.memory.traces import StageTrace, compose
from engine.memory.tracker import CUDA_BLOCK, round_up
from engine.schedule.actions import ActionKind, split_units
from engine.schedule.generators import SCHEDULES
from engine.schedule.schedule import Schedule
from engine.schedule.validate import validate
from models import LayerSpec
from partitioners import Partition, partition_model

__all__ = [
    "DEVICE_MODELS",
    "Layout",
    "MemoryConfig",
    "MemoryReport",
    "StageMemory",
    "estimate_memory",
    "resolve",
    "stage_memory",
    "stage_shape",
    "stage_trace",
    "stage_trace_request",
    "trace_requests",
]


@dataclass(frozen=True, kw_only=True)
class StageMemory:
    """Bytes one stage holds on the modelled device."""

    stage: int
    rank: int
    """Pipeline rank that holds the stage."""
    layers: tuple[int, int]
    """Global layer range `[first, stop)`."""
    parameters: int
    """Parameter count (a weight shared inside the stage counts once)."""
    weights: int
    """Kept across steps: fp32 parameters (under bf16/fp16 the masters autocast casts from);
    under ZeRO-1/2 the working weights (Linears in the compute dtype), under ZeRO-3 the fp32
    shards (`engine.memory.sharding`)."""
    gradients: int
    """fp32 gradients while the step accumulates; the step's backwards allocate them, so
    `step_peak` holds them."""
    optimizer: int
    """AdamW's two fp32 states; under ZeRO this replica's shard of them and of the masters."""
    recompute: str
    """The stage's recompute policy."""
    kept_per_micro_batch: int
    """What one forward leaves alive until its backward (stash, send)."""
    weight_copies: int
    """The low-precision weight copies autocast makes: once per step, at the stage's first
    forward, shared by every micro-batch and kept to the step's end. None under ZeRO: 1/2 keep
    the Linears in the compute dtype already, 3 gathers them (`ShardedStates.gathered`)."""
    in_flight: int
    """Most micro-batches whose forward ran and whose backward has not."""
    step_peak: int
    """Peak over the step on top of weights and optimizer states: activations, gradients,
    buffers, the DP all-reduce and the optimizer's temporaries."""
    replica_copies: int = 0
    """Kept across steps by `--dp-sync`: DiLoCo's last-meeting weights and outer momentum,
    the parameter server's fp32 masters on its rank (`replica_sync_bytes`)."""

    @property
    def kept(self) -> int:
        """Bytes kept across steps: weights, optimizer states and the dp sync's copies."""
        return self.weights + self.optimizer + self.replica_copies

    @property
    def peak(self) -> int:
        return self.kept + self.step_peak


@dataclass(frozen=True, kw_only=True)
class MemoryReport:
    """Per-stage memory of one layout and the peak of each pipeline rank."""

    config: MemoryConfig
    partition: Partition
    stages: tuple[StageMemory, ...]
    rank_peaks: tuple[int, ...]
    """Per rank: its stages' weights and optimizer states plus the peak of its whole row."""
    source: str
    """`predicted` (fake replay) or `measured on cpu` / `measured on cuda`."""
    allocator_peaks: tuple[int | None, ...] | None = None
    """Measured runs: the allocator's own step peak per stage (a cross-check, not asserted)."""

    @property
    def peak(self) -> int:
        return max(self.rank_peaks)

    def ranks_over(self, device_memory: int) -> tuple[int, ...]:
        """Ranks whose peak exceeds `device_memory` bytes."""
        return tuple(r for r, peak in enumerate(self.rank_peaks) if peak > device_memory)


@dataclass(frozen=True, kw_only=True)
class Layout:
    """A config resolved: layer list, partition, schedule, and what a micro-batch looks like."""

    specs: tuple[LayerSpec, ...]
    partition: Partition
    schedule: Schedule
    states: StateLayout
    """How model states sit on the device (ZeRO-1, allocation block, optimizer)."""

    @property
    def block(self) -> int:
        """Allocation granularity of the modelled device (512 for CUDA)."""
        return self.states.block

    def stage_specs(self, stage: int) -> tuple[LayerSpec, ...]:
        return tuple(self.specs[i] for i in self.partition.layers_of(stage))

    def shape(self, config: MemoryConfig, stage: int) -> StageShape:
        return stage_shape(config, stage)

    def params(self, stages: Sequence[int]) -> list[ParamInfo]:
        """One rank's parameters of `stages` (its tensor-parallel shard of each)."""
        tp = self.states.tp
        found: list[ParamInfo] = []
        for s in stages:  # layer positions run on across the rank's stages
            offset = 1 + max((p.layer for p in found), default=-1)
            found += [
                replace(p, layer=p.layer + offset) for p in stage_params(self.stage_specs(s), tp)
            ]
        return found


def stage_shape(config: MemoryConfig, stage: int) -> StageShape:
    """What one micro-batch of `stage` looks like to the replay."""
    return StageShape(
        micro_batches=config.schedule.micro_batches,
        micro_batch_size=config.micro_batch_size,
        seq_len=config.batch.seq_len,
        hidden=config.model.config().d_model,
        divisor=config.schedule.micro_batches * config.parallel.dp,
        precision=config.engine.precision,
        recompute=config.engine.recompute_of(stage),
        tp=config.parallel.tp,
        sequence_parallel=config.engine.sequence_parallel,
        fsdp_replicas=config.parallel.dp if config.engine.zero == 3 else 0,
        fsdp_reshard=config.engine.reshard_of(stage),
    )


def _partition(config: MemoryConfig, specs: Sequence[LayerSpec], schedule: Schedule) -> Partition:
    """The config's partition; `memory` is the fastest split that fits its budget."""
    if not config.partition.by_memory:
        return partition_model(
            specs,
            method=config.partition.partition,
            num_stages=config.num_stages,
            cost_model=config.partition.cost_model,
            batch_size=config.micro_batch_size,
            seq_len=config.batch.seq_len,
        )
    return replayed_fitting_partition(
        config,
        specs,
        schedule,
        shape=stage_shape(config, 0),
        rank_peaks=lambda chosen: estimate_memory(chosen).rank_peaks,
    )


@functools.lru_cache(maxsize=8)
def resolve(config: MemoryConfig) -> Layout:
    """Partition the model and build the schedule the config names (kept for the last few
    configs: the planner, `suggest` and `estimate_memory` resolve the same one again)."""
    specs = tuple(config.model.specs())
    schedule = config.schedule.resolve(config.parallel.pp)
    if config.schedule.schedule not in SCHEDULES or config.schedule.placement is not None:
        validate(schedule)  # a generator's own is valid by its tests (the planner's, every one)
    partition = _partition(config, specs, schedule)
    states = StateLayout(
        dp=config.parallel.dp,
        zero=config.engine.zero,
        zero_reshard=config.engine.zero_reshard,
        tp=config.parallel.tp,
        block=CUDA_BLOCK if config.device == "cuda" else 1,
        optimizer_impl=config.optimizer.impl,
        device=config.device,
    )
    return Layout(specs=specs, partition=partition, schedule=schedule, states=states)


def stage_trace(config: MemoryConfig, layout: Layout, stage: int) -> StageTrace:
    """The stage's traced step start and micro-batches, shared by stages built alike."""
    return cached_trace(*stage_trace_request(config, layout, stage))


def stage_trace_request(config: MemoryConfig, layout: Layout, stage: int) -> TraceRequest:
    """What `stage_trace` traces for the stage (for `trace_ahead`)."""
    actions = stage_actions(layout.schedule, stage)
    styles = backward_styles(actions)
    split = split_units(actions)
    first_forward = next((a for a in actions if a.kind is ActionKind.F), None)
    if styles and first_forward is not None:
        style = (stage, first_forward.micro_batch) in split
        require(
            style == styles[0],
            f"schedule {layout.schedule.name!r}: stage {stage}'s first forward is of a "
            f"micro-batch whose backward is {'split' if style else 'fused'}, but its first "
            "backward is not; the memory model traces the weight casts of the first forward "
            "with the first backward's style: order the stage's micro-batches alike",
        )
    return TraceRequest(
        layout.stage_specs(stage),
        stage == 0,
        stage == layout.partition.num_stages - 1,
        styles,
        layout.shape(config, stage),
        config.device,
        local_edges(layout.schedule, stage),
    )


def trace_requests(config: MemoryConfig) -> list[TraceRequest]:
    """Every stage trace `estimate_memory(config)` reads."""
    layout = resolve(config)
    return [stage_trace_request(config, layout, s) for s in range(layout.partition.num_stages)]


def _step_peak(
    config: MemoryConfig, layout: Layout, stages: Sequence[int], traces: Mapping[int, StageTrace]
) -> int:
    """Peak of a row's replay on `stages`, then of the step's tail (DP all-reduce, optimizer)."""
    releases = sends_released(layout.schedule, stages)
    events = rank_events(layout.schedule, stages, releases)
    zero = layout.states.zero
    peak, live = compose(stages, events, traces, gradients_first=zero in (1, 2), releases=releases)
    held = sum(config.schedule.micro_batches * traces[s].held_per_micro_batch for s in stages)
    held -= sum(traces[sent.stage].sent_back for sends in releases.values() for sent in sends)
    cached = sum(traces[s].weight_copies for s in stages)
    params = layout.params(stages)
    if layout.states.zero == 3:
        reduces = [traces[s].reduce for s in stages]
        return fsdp_step_peak(
            params, layout.states, peak=peak, live_end=live, held=held, reduces=reduces
        )
    if layout.states.zero:
        return sharded_step_peak(
            sharded_states(params, layout.states, precision=config.engine.precision),
            layout.states,
            params,
            peak=peak,
            live_end=live,
            held=held,
            cached=cached,
            precision=config.engine.precision,
        )
    after = tail_peak(params, live_end=live, held=held, cached=cached, states=layout.states)
    return max(peak, after)


def estimate_memory(config: MemoryConfig) -> MemoryReport:
    """Predict every stage's and rank's peak from fake replays; allocates no model memory."""
    layout = resolve(config)
    traces = {s: stage_trace(config, layout, s) for s in range(layout.partition.num_stages)}
    stages = tuple(
        stage_memory(
            config,
            layout,
            s,
            kept=traces[s].kept_per_micro_batch,
            weight_copies=traces[s].weight_copies,
            step_peak=_step_peak(config, layout, [s], traces),
        )
        for s in range(layout.partition.num_stages)
    )
    rank_peaks = tuple(
        _step_peak(config, layout, layout.schedule.stages_of(r), traces)
        + sum(stages[s].kept for s in layout.schedule.stages_of(r))
        for r in range(config.parallel.pp)
    )
    return MemoryReport(
        config=config,
        partition=layout.partition,
        stages=stages,
        rank_peaks=rank_peaks,
        source="predicted",
    )


def _states(
    config: MemoryConfig, layout: Layout, stage: int, params: Sequence[ParamInfo]
) -> dict[str, int]:
    """Weights, gradients and optimizer bytes of one replica's `params`, those of `stage` (what
    a layer's turn gathers is the step's, not kept: `_step_peak`)."""
    if layout.states.zero:
        states = replace(layout.states, zero_reshard=config.engine.reshard_of(stage))
        sharded = sharded_states(params, states, precision=config.engine.precision)
        return {
            "weights": sharded.weights,
            "gradients": sharded.gradients,
            "optimizer": sharded.optimizer,
        }
    fp32 = sum(round_up(4 * p.numel, layout.block) for p in params)
    return {
        "weights": fp32,
        "gradients": fp32,
        "optimizer": optimizer_bytes(params, layout.states),
    }


def stage_memory(
    config: MemoryConfig,
    layout: Layout,
    stage: int,
    *,
    kept: int,
    weight_copies: int,
    step_peak: int,
) -> StageMemory:
    """A stage's row of the report: states from its shapes, the rest as replayed."""
    params = layout.params([stage])
    layers = layout.partition.layers_of(stage)
    return StageMemory(
        stage=stage,
        rank=layout.schedule.rank_of(stage),
        layers=(layers.start, layers.stop),
        parameters=sum(p.numel for p in params),
        **_states(config, layout, stage, params),
        recompute=config.engine.recompute_of(stage),
        kept_per_micro_batch=kept,
        weight_copies=0 if layout.states.zero else weight_copies,
        in_flight=in_flight(stage_actions(layout.schedule, stage)),
        step_peak=step_peak,
        replica_copies=replica_sync_bytes(params, config.replica_sync, layout.block),
    )
