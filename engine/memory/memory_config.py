"""One training layout whose memory is estimated (`MemoryConfig`): the sections a training
run shares (`engine.config`), at the defaults of a realistic GPU run, the device model, and the
checks that refuse what the memory model cannot replay exactly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.config import (
    BatchConfig,
    EngineOptions,
    ModelChoice,
    OptimizerSpec,
    ParallelConfig,
    PartitionConfig,
    ReplicaSync,
    ScheduleConfig,
    check_budget,
    check_layout,
    check_replica_sync,
    from_flat,
    require,
    to_flat,
)
from engine.memory.states import OPTIMIZER_IMPLS
from partitioners import COST_MODELS

__all__ = ["DEVICE_MODELS", "MemoryConfig"]

DEVICE_MODELS = ("cuda", "cpu")
"""`cuda`: 512-byte allocator blocks and CUDA's fused kernels; `cpu`: exact bytes, CPU kernels."""

_COST_MODELS = tuple(name for name in COST_MODELS if name != "time")
"""The cost models an estimate can partition by: all but `time`, which runs the layers."""


@dataclass(frozen=True, kw_only=True)
class MemoryConfig:
    """One training layout whose memory is estimated: the sections a training run shares
    (`engine.config`), at the defaults of a realistic GPU run (bf16), and the device model."""

    model: ModelChoice = field(default_factory=ModelChoice)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    partition: PartitionConfig = field(default_factory=PartitionConfig)
    batch: BatchConfig = field(default_factory=lambda: BatchConfig(global_batch=4))
    engine: EngineOptions = field(default_factory=lambda: EngineOptions(precision="bf16"))
    optimizer: OptimizerSpec = field(default_factory=OptimizerSpec)
    replica_sync: ReplicaSync = field(default_factory=ReplicaSync)
    """How the replicas stay together: DiLoCo and the parameter server keep more copies."""
    device: str = "cuda"
    """Device model: cuda (512-byte allocator blocks, CUDA's kernels) or cpu (exact bytes)."""

    def __post_init__(self) -> None:
        require(
            self.device in DEVICE_MODELS,
            f"device {self.device!r} unknown: use {' or '.join(DEVICE_MODELS)}",
        )
        require(
            self.optimizer.impl in OPTIMIZER_IMPLS,
            f"optimizer implementation {self.optimizer.impl!r}: the model covers "
            f"{' and '.join(OPTIMIZER_IMPLS)} (deepspeed_cpu keeps AdamW's states on the host)",
        )
        require(
            self.optimizer.name == "adamw",
            f"optimizer {self.optimizer.name!r}: the memory model covers AdamW's states; "
            "estimate with --optimizer adamw (SGD keeps less)",
        )
        require(
            not self.engine.compile,
            "--compile: the memory model replays eager layers (a compiled layer fuses and "
            "keeps other tensors): estimate without --compile",
        )
        require(
            self.partition.cost_model in _COST_MODELS,
            f"cost model {self.partition.cost_model!r} profiles layers by running them, which "
            f"an estimate made without allocating cannot: choose one of {', '.join(_COST_MODELS)}",
        )
        check_budget(self.partition, self.engine)
        check_layout(
            model=self.model,
            parallel=self.parallel,
            schedule=self.schedule,
            batch=self.batch,
            engine=self.engine,
        )
        check_replica_sync(
            self.replica_sync,
            dp=self.parallel.dp,
            zero=self.engine.zero,
            saves=False,
            save_every=1,
            steps=1,
        )

    @staticmethod
    def of(*, micro_batch_size: int | None = None, **fields: Any) -> MemoryConfig:
        """A config from flat names (`pp=4, seq_len=4096, precision="bf16"`); the batch as
        `global_batch` or, as people size memory, `micro_batch_size` (times micro-batches and
        replicas; 1 sequence when neither is given)."""
        if "global_batch" not in fields:
            size = 1 if micro_batch_size is None else micro_batch_size
            require(size >= 1, f"micro_batch_size={size} must be at least 1")
            defaults = to_flat(MemoryConfig())
            dp, m = (int(fields.get(n, defaults[n])) for n in ("dp", "micro_batches"))
            fields["global_batch"] = size * max(dp, 1) * max(m, 1)
        else:
            require(
                micro_batch_size is None,
                "give the batch as global_batch or as micro_batch_size, not both",
            )
        config: MemoryConfig = from_flat(MemoryConfig, fields)
        return config

    @property
    def num_stages(self) -> int:
        return self.parallel.pp * self.schedule.stages_per_rank

    @property
    def micro_batch_size(self) -> int:
        """Sequences per micro-batch."""
        return self.batch.micro_batch_size(self.parallel.dp, self.schedule.micro_batches)
