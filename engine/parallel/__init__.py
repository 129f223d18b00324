"""What shards a stage over its data-parallel replicas: ZeRO-1/2 flat buffers with sharded
fp32 masters and optimizer state (Megatron's distributed optimizer), and ZeRO-3 through
FSDP2."""

from engine.parallel.flat import FlatGroup, add_into_main_grad, castable_linear_params
from engine.parallel.fsdp import FullyShardedLayers, check_unshared, shard_layers
from engine.parallel.zero import OptimizerBuilder, ShardedOptimizer

__all__ = [
    "FlatGroup",
    "FullyShardedLayers",
    "OptimizerBuilder",
    "ShardedOptimizer",
    "add_into_main_grad",
    "castable_linear_params",
    "check_unshared",
    "shard_layers",
]
