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
from dataclasses import dataclass

from engine.memory.replay import (
    StageShape,
    StageTrace,
    backward_styles,
    compose,
    in_flight,
    stage_actions,
    trace_stage,
)
from engine.memory.states import (
    OPTIMIZER_IMPLS,
    ParamInfo,
    StateLayout,
    optimizer_bytes,
    stage_params,
    tail_peak,
)
from engine.memory.tracker import CUDA_BLOCK, round_up
from engine.runtime.options import recompute_groups
from engine.runtime.precision import PRECISIONS
from engine.schedule.actions import ActionKind, split_units
from engine.schedule.generators import SCHEDULES, make_schedule
from engine.schedule.schedule import Schedule
from engine.schedule.validate import validate
from models import LayerSpec, get_config, layer_specs
from partitioners import COST_MODELS, Partition, partition_model

__all__ = [
    "DEVICE_MODELS",
    "Layout",
    "MemoryConfig",
    "MemoryReport",
    "StageMemory",
    "cached_trace",
    "estimate_memory",
    "resolve",
    "stage_memory",
    "stage_trace",
]

DEVICE_MODELS = ("cuda", "cpu")
"""`cuda`: 512-byte allocator blocks and CUDA's fused kernels; `cpu`: exact bytes, CPU kernels."""

_COST_MODELS = tuple(name for name in COST_MODELS if name != "time")
"""The cost models an estimate can partition by: all but `time`, which runs the layers."""


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


@dataclass(frozen=True, kw_only=True)
class MemoryConfig:
    """One training layout whose memory is estimated; validated once, on construction."""

    model: str = "gpt-tiny"
    """A registered model name."""
    pp: int = 1
    """Pipeline ranks."""
    dp: int = 1
    """Data-parallel replicas (the DP all-reduce's buffers and ZeRO-1 depend on it)."""
    schedule: str = "1f1b"
    """A name from `engine.schedules.SCHEDULES`."""
    stages_per_rank: int = 1
    """Virtual stages per rank, for the schedules that take them."""
    micro_batches: int = 4
    """Micro-batches per step and replica."""
    micro_batch_size: int = 1
    """Sequences per micro-batch."""
    seq_len: int = 128
    """Tokens per sequence."""
    precision: str = "bf16"
    """`fp32`, or `bf16` / `fp16` autocast over fp32 weights and gradients, as the engine runs."""
    partition: str = "balanced"
    """Partition method, as `meshpipe plan` takes it."""
    cost_model: str = "flops"
    """Costs `balanced` balances: flops, parameters or activations."""
    recompute: str = "none"
    """Recompute policy, as `EngineOptions.recompute`: none, full or every:N."""
    recompute_stages: tuple[int, ...] | None = None
    """Stages the policy applies to; None (the engine's behaviour) means all."""
    zero: int = 0
    """1 shards AdamW's states over the dp replicas (ZeRO-1)."""
    optimizer_impl: str = "fused"
    """AdamW's implementation, as `TrainConfig.optimizer_impl`: fused or per_tensor."""
    device: str = "cuda"
    """Device model: `cuda` or `cpu` (see `DEVICE_MODELS`)."""

    def __post_init__(self) -> None:
        config = get_config(self.model)
        for name in ("pp", "dp", "stages_per_rank", "micro_batches", "micro_batch_size", "seq_len"):
            value = getattr(self, name)
            _require(value >= 1, f"{name.replace('_', '-')}={value} must be at least 1")
        _require(
            self.precision in PRECISIONS,
            f"precision {self.precision!r} unknown: use {', '.join(PRECISIONS)}",
        )
        _require(
            self.device in DEVICE_MODELS,
            f"device {self.device!r} unknown: use {' or '.join(DEVICE_MODELS)}",
        )
        _require(self.zero in (0, 1), f"zero={self.zero}: use 0 (none) or 1 (ZeRO-1)")
        _require(
            self.optimizer_impl in OPTIMIZER_IMPLS,
            f"optimizer implementation {self.optimizer_impl!r}: the model covers "
            f"{' and '.join(OPTIMIZER_IMPLS)} (deepspeed_cpu keeps AdamW's states on the host)",
        )
        _require(
            self.schedule in SCHEDULES,
            f"unknown schedule {self.schedule!r}: choose one of {', '.join(SCHEDULES)}",
        )
        _require(
            self.cost_model in COST_MODELS,
            f"unknown cost model {self.cost_model!r}: choose one of {', '.join(_COST_MODELS)}",
        )
        _require(
            self.cost_model in _COST_MODELS,
            f"cost model {self.cost_model!r} profiles layers by running them, which an estimate "
            f"made without allocating cannot: choose one of {', '.join(_COST_MODELS)}",
        )
        recompute_groups(1, self.recompute)
        if self.recompute_stages is not None and self.recompute == "none":
            stages = ",".join(map(str, self.recompute_stages))
            raise ValueError(
                f"--recompute-stages {stages} has nothing to apply: --recompute is none; add "
                "--recompute full (or every:N), or drop --recompute-stages"
            )
        self._check_sizes(config.max_seq_len, len(layer_specs(config)))

    def _check_sizes(self, context: int, layers: int) -> None:
        _require(
            self.seq_len <= context,
            f"seq-len={self.seq_len} is longer than {self.model}'s context of {context}: "
            f"use --seq-len {context} or less",
        )
        _require(
            self.num_stages <= layers,
            f"{self.num_stages} stages for {self.model}'s {layers} layers: use at most "
            f"{layers} stages (pp × stages-per-rank)",
        )
        bad = [s for s in self.recompute_stages or () if not 0 <= s < self.num_stages]
        _require(not bad, f"recompute stages {bad} are outside 0..{self.num_stages - 1}")

    @property
    def num_stages(self) -> int:
        return self.pp * self.stages_per_rank

    def recompute_of(self, stage: int) -> str:
        """The recompute policy `stage` runs."""
        chosen = self.recompute_stages is None or stage in self.recompute_stages
        return self.recompute if chosen else "none"


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
    """fp32 parameters: under bf16/fp16 they are the master weights autocast casts from."""
    gradients: int
    """fp32 gradients; the step's first backward allocates them, so `step_peak` holds them."""
    optimizer: int
    """AdamW's two fp32 states (ZeRO-1: the largest replica's shard)."""
    recompute: str
    """The stage's recompute policy."""
    kept_per_micro_batch: int
    """What one forward leaves alive until its backward (stash, send)."""
    weight_copies: int
    """The low-precision weight copies autocast makes: once per step, at the stage's first
    forward, shared by every micro-batch and kept to the step's end."""
    in_flight: int
    """Most micro-batches whose forward ran and whose backward has not."""
    step_peak: int
    """Peak over the step on top of weights and optimizer states: activations, gradients,
    buffers, the DP all-reduce and the optimizer's temporaries."""

    @property
    def peak(self) -> int:
        return self.weights + self.optimizer + self.step_peak


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

    specs: list[LayerSpec]
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
        return StageShape(
            micro_batches=config.micro_batches,
            micro_batch_size=config.micro_batch_size,
            seq_len=config.seq_len,
            hidden=get_config(config.model).d_model,
            divisor=config.micro_batches * config.dp,
            precision=config.precision,
            recompute=config.recompute_of(stage),
        )

    def params(self, stages: Sequence[int]) -> list[ParamInfo]:
        return [p for s in stages for p in stage_params(self.stage_specs(s))]


def resolve(config: MemoryConfig) -> Layout:
    """Partition the model and build the schedule the config names."""
    specs = layer_specs(config.model)
    partition = partition_model(
        specs,
        method=config.partition,
        num_stages=config.num_stages,
        cost_model=config.cost_model,
        batch_size=config.micro_batch_size,
        seq_len=config.seq_len,
    )
    extra = {"stages_per_rank": config.stages_per_rank} if config.stages_per_rank > 1 else {}
    schedule = make_schedule(
        config.schedule, num_ranks=config.pp, micro_batches=config.micro_batches, **extra
    )
    validate(schedule)
    for s in range(schedule.num_stages - 1):
        _require(
            schedule.rank_of(s) != schedule.rank_of(s + 1),
            f"schedule {schedule.name!r} puts stages {s} and {s + 1} on rank "
            f"{schedule.rank_of(s)}; the memory model replays every stage boundary as a "
            "transfer between ranks: use pp >= 2",
        )
    states = StateLayout(
        dp=config.dp,
        zero=config.zero,
        block=CUDA_BLOCK if config.device == "cuda" else 1,
        optimizer_impl=config.optimizer_impl,
        device=config.device,
    )
    return Layout(specs=specs, partition=partition, schedule=schedule, states=states)


@functools.lru_cache(maxsize=256)
def cached_trace(
    specs: tuple[LayerSpec, ...],
    first: bool,
    last: bool,
    styles: tuple[bool, ...],
    shape: StageShape,
    device: str,
) -> StageTrace:
    """`trace_stage`, once per distinct stage: stages built alike allocate alike."""
    cuda = device == "cuda"
    block = CUDA_BLOCK if cuda else 1
    return trace_stage(
        specs, first=first, last=last, styles=styles, shape=shape, cuda=cuda, block=block
    )


def stage_trace(config: MemoryConfig, layout: Layout, stage: int) -> StageTrace:
    """The stage's traced step start and micro-batches, shared by stages built alike."""
    actions = stage_actions(layout.schedule, stage)
    styles = backward_styles(actions)
    split = split_units(actions)
    first_forward = next((a for a in actions if a.kind is ActionKind.F), None)
    if styles and first_forward is not None:
        style = (stage, first_forward.micro_batch) in split
        _require(
            style == styles[0],
            f"schedule {layout.schedule.name!r}: stage {stage}'s first forward is of a "
            f"micro-batch whose backward is {'split' if style else 'fused'}, but its first "
            "backward is not; the memory model traces the weight casts of the first forward "
            "with the first backward's style: order the stage's micro-batches alike",
        )
    last = stage == layout.partition.num_stages - 1
    return cached_trace(
        layout.stage_specs(stage),
        stage == 0,
        last,
        styles,
        layout.shape(config, stage),
        config.device,
    )


def _step_peak(
    config: MemoryConfig, layout: Layout, stages: Sequence[int], traces: Mapping[int, StageTrace]
) -> int:
    """Peak of a row's replay on `stages`, then of the step's tail (DP all-reduce, optimizer)."""
    actions = [
        a
        for a in layout.schedule.rows[layout.schedule.rank_of(stages[0])]
        if a.is_compute and a.stage in stages
    ]
    peak, live = compose(stages, actions, traces)
    held = sum(config.micro_batches * traces[s].held_per_micro_batch for s in stages)
    cached = sum(traces[s].weight_copies for s in stages)
    params = layout.params(stages)
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
        + sum(stages[s].weights + stages[s].optimizer for s in layout.schedule.stages_of(r))
        for r in range(config.pp)
    )
    return MemoryReport(
        config=config,
        partition=layout.partition,
        stages=stages,
        rank_peaks=rank_peaks,
        source="predicted",
    )


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
        weights=sum(round_up(4 * p.numel, layout.block) for p in params),
        gradients=sum(round_up(4 * p.numel, layout.block) for p in params),
        optimizer=optimizer_bytes(params, layout.states),
        recompute=config.recompute_of(stage),
        kept_per_micro_batch=kept,
        weight_copies=weight_copies,
        in_flight=in_flight(stage_actions(layout.schedule, stage)),
        step_peak=step_peak,
    )
