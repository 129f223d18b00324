"""The one configuration vocabulary: per-concern frozen sections (model, parallelism,
schedule, partition, batch, engine options, optimizer, learning rate, data, checkpoints, run)
that `TrainConfig`, `MemoryConfig` and the engine share, each field validated once, each with
one flat name for flags, DeepSpeed mapping and checkpoints (`engine.config.fields`).
"""

from engine.config.batch import BatchConfig
from engine.config.engine_options import (
    LOSS_SCALE_FIELDS,
    PRECISIONS,
    ZERO_LEVELS,
    ZERO_RESHARDS,
    EngineOptions,
    check_tp_optimizer,
    check_zero_optimizer,
    recompute_groups,
)
from engine.config.fault_tolerance import FaultTolerance, check_fault_tolerance
from engine.config.fields import FlatField, flat_fields, from_flat, replace_flat, require, to_flat
from engine.config.layout import check_budget, check_layout
from engine.config.model import ModelChoice
from engine.config.optimizer import (
    DEEPSPEED_SCHEDULERS,
    IMPLEMENTATIONS,
    LR_SCHEDULES,
    OPTIMIZERS,
    LRSchedule,
    OptimizerSpec,
)
from engine.config.parallel import MESH_DIMS, ParallelConfig, parse_mesh_order
from engine.config.replica_sync import DP_SYNCS, ReplicaSync, check_replica_sync
from engine.config.run import (
    DATA_ORDERS,
    DEVICES,
    CheckpointConfig,
    DataConfig,
    MonitorConfig,
    RunConfig,
)
from engine.config.schedule import PartitionConfig, ScheduleConfig
from engine.config.sizes import format_size, parse_size

__all__ = [
    "DATA_ORDERS",
    "DEEPSPEED_SCHEDULERS",
    "DEVICES",
    "DP_SYNCS",
    "IMPLEMENTATIONS",
    "LOSS_SCALE_FIELDS",
    "LR_SCHEDULES",
    "MESH_DIMS",
    "OPTIMIZERS",
    "PRECISIONS",
    "ZERO_LEVELS",
    "ZERO_RESHARDS",
    "BatchConfig",
    "CheckpointConfig",
    "DataConfig",
    "EngineOptions",
    "FaultTolerance",
    "FlatField",
    "LRSchedule",
    "ModelChoice",
    "MonitorConfig",
    "OptimizerSpec",
    "ParallelConfig",
    "PartitionConfig",
    "ReplicaSync",
    "RunConfig",
    "ScheduleConfig",
    "check_budget",
    "check_fault_tolerance",
    "check_layout",
    "check_replica_sync",
    "check_tp_optimizer",
    "check_zero_optimizer",
    "flat_fields",
    "format_size",
    "from_flat",
    "parse_mesh_order",
    "parse_size",
    "recompute_groups",
    "replace_flat",
    "require",
    "to_flat",
]
