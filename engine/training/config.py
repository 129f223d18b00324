"""Typed configuration of a training run, validated once before any compute.

A run is a set of per-concern sections (`engine.config`): each field is validated by its
section, the checks that span sections by `check_layout` (shared with `meshpipe memory`), and
what only a training run combines (restarts need a resume) here. `TrainConfig.of` builds one
from flat names, as the CLI, DeepSpeed configs and checkpoints spell them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from engine.config import (
    BatchConfig,
    CheckpointConfig,
    DataConfig,
    EngineOptions,
    FaultTolerance,
    LRSchedule,
    ModelChoice,
    MonitorConfig,
    OptimizerSpec,
    ParallelConfig,
    PartitionConfig,
    ReplicaSync,
    RunConfig,
    ScheduleConfig,
    check_budget,
    check_fault_tolerance,
    check_layout,
    check_replica_sync,
    check_tp_optimizer,
    check_zero_optimizer,
    flat_fields,
    from_flat,
    require,
    to_flat,
)
from engine.training.deepspeed_config import (
    check_agreement,
    deepspeed_defaults,
    deepspeed_overrides,
    read_deepspeed_config,
)

__all__ = ["TrainConfig"]


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Everything that defines a training run; two runs with equal configs are identical."""

    model: ModelChoice = field(default_factory=ModelChoice)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    partition: PartitionConfig = field(default_factory=PartitionConfig)
    batch: BatchConfig = field(default_factory=BatchConfig)
    engine: EngineOptions = field(default_factory=lambda: EngineOptions(clip_grad_norm=1.0))
    """Clipping at 1.0 by default (DeepSpeed's and nanoGPT's habit): with lr 1e-3 the README's
    first command learns (below 2.5 nats/token in 200 steps) instead of flattening at the
    corpus's byte entropy (~3.2), as it did with no clipping and lr 3e-3."""
    optimizer: OptimizerSpec = field(
        default_factory=lambda: OptimizerSpec(lr=1e-3, weight_decay=0.1)
    )
    learning_rate: LRSchedule = field(default_factory=LRSchedule)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    run: RunConfig = field(default_factory=RunConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    replica_sync: ReplicaSync = field(default_factory=ReplicaSync)
    fault_tolerance: FaultTolerance = field(default_factory=FaultTolerance)

    def __post_init__(self) -> None:
        check_layout(
            model=self.model,
            parallel=self.parallel,
            schedule=self.schedule,
            batch=self.batch,
            engine=self.engine,
        )
        check_budget(self.partition, self.engine)
        world = self.parallel.pp * self.parallel.dp
        check_zero_optimizer(self.engine.zero, self.optimizer.impl, world)
        check_tp_optimizer(
            self.parallel.tp, self.engine.zero, self.optimizer.name, self.optimizer.impl
        )
        require(
            self.monitor.flops_profile_step <= self.run.steps,
            f"--flops-profile-step {self.monitor.flops_profile_step} is after the run's last "
            f"step ({self.run.steps}): give a step from 1 to {self.run.steps} (a DeepSpeed "
            "config's flops_profiler.profile_step P is step P + 1)",
        )
        check_replica_sync(
            self.replica_sync,
            dp=self.parallel.dp,
            zero=self.engine.zero,
            saves=self.checkpoint.checkpoint_dir is not None,
            save_every=self.checkpoint.save_every,
            steps=self.run.steps,
        )
        require(
            not (self.data.pack_documents and self.engine.compile),
            "--pack-documents with --compile: compiled layers are not checked to read the "
            "document ids of each micro-batch; train packed documents without --compile",
        )
        check_fault_tolerance(
            self.fault_tolerance,
            dp=self.parallel.dp,
            tp=self.parallel.tp,
            zero=self.engine.zero,
            dp_sync=self.replica_sync.dp_sync,
        )
        require(  # a fault-tolerant replica relaunches from a live peer, not from disk
            self.checkpoint.resume
            or self.run.max_restarts == 0
            or self.fault_tolerance.fault_tolerant,
            f"--max-restarts {self.run.max_restarts} restarts would start over from step 0: "
            "add --resume (and --save-every) so restarted ranks continue from the last checkpoint",
        )

    @staticmethod
    def of(**fields: Any) -> TrainConfig:
        """A config from flat names (`pp=2, seq_len=64, betas="0.9,0.95"`), the others at
        their defaults."""
        config: TrainConfig = from_flat(TrainConfig, fields)
        return config

    def flat(self) -> dict[str, Any]:
        """Every setting under its flat name: what checkpoints record and resumes compare."""
        return to_flat(self)

    @staticmethod
    def from_deepspeed(path: str | Mapping[str, Any], **fields: Any) -> TrainConfig:
        """A config whose batch, optimizer, schedule, precision and loss scaling, clipping,
        ZeRO, pipeline, logging and monitors come from a DeepSpeed JSON (a path or a parsed
        dict); `fields` (flat names, the flags given) give the rest (model, pp, dp…), fill
        its "auto" values, and must not contradict it (refused naming both). A setting the
        JSON omits takes DeepSpeed's default (`deepspeed_defaults`) unless `fields` give it,
        so a DeepSpeed config trains alike."""
        json_config = read_deepspeed_config(path)
        source = "the DeepSpeed config" if isinstance(path, Mapping) else str(path)
        flags = {**TrainConfig.of().flat(), **fields}
        overrides = deepspeed_overrides(json_config, dp=int(flags["dp"]), flags=flags)
        check_agreement(fields, overrides, source, _normalise)
        chosen = {**fields, **overrides}
        precision = chosen.get("precision", flags["precision"])
        for name, value in deepspeed_defaults(json_config, precision=precision).items():
            chosen.setdefault(name, value)
        return TrainConfig.of(**chosen)


def _normalise(name: str, value: Any) -> Any:
    """A flat setting in its field's form, so "0.9,0.95" and (0.9, 0.95) compare equal."""
    for flat_field in flat_fields(TrainConfig):
        if flat_field.name == name:
            return flat_field.field_value(value)
    return value
