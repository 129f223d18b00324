"""What shards a stage across ranks: tensor-parallel plans (DTensor) over the mesh's `tp`
dimension; over its `dp` replicas, ZeRO-1/2 flat buffers with sharded fp32 masters and
optimizer state (Megatron's distributed optimizer) and ZeRO-3 through FSDP2; or replicas that
train alone and meet every H steps (local SGD, DiLoCo), or push to a parameter server."""

from engine.parallel.flat import (
    FlatGroup,
    add_into_main_grad,
    castable_linear_params,
    local_gradient,
)
from engine.parallel.fsdp import (
    FullyShardedLayers,
    check_unshared,
    fold_compute_gradients,
    shard_layers,
)
from engine.parallel.param_server import ParameterServer
from engine.parallel.replica_meeting import ReplicaMeetings
from engine.parallel.tensor_parallel import (
    SequenceShards,
    align_gradients,
    as_gradient_of,
    build_sharded_layers,
    full_tensor,
    local_tensor,
    parallelize_layers,
    shard_arriving_gradients,
    shard_like,
    sharded_loss_scope,
    split_gradient_norms,
    split_over_tp,
    stage_layers,
)
from engine.parallel.zero import OptimizerBuilder, ShardedOptimizer

__all__ = [
    "FlatGroup",
    "FullyShardedLayers",
    "OptimizerBuilder",
    "ParameterServer",
    "ReplicaMeetings",
    "SequenceShards",
    "ShardedOptimizer",
    "add_into_main_grad",
    "align_gradients",
    "as_gradient_of",
    "build_sharded_layers",
    "castable_linear_params",
    "check_unshared",
    "fold_compute_gradients",
    "full_tensor",
    "local_gradient",
    "local_tensor",
    "parallelize_layers",
    "shard_arriving_gradients",
    "shard_layers",
    "shard_like",
    "sharded_loss_scope",
    "split_gradient_norms",
    "split_over_tp",
    "stage_layers",
]
