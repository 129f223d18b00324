"""What shards a stage across ranks: tensor-parallel plans (DTensor) over the mesh's `tp`
dimension (the ZeRO levels over `dp` live here too)."""

from engine.parallel.tensor_parallel import (
    SequenceShards,
    align_gradients,
    as_gradient_of,
    build_sharded_layers,
    full_tensor,
    local_tensor,
    parallelize_layers,
    shard_like,
    sharded_loss_scope,
    split_gradient_norms,
)

__all__ = [
    "SequenceShards",
    "align_gradients",
    "as_gradient_of",
    "build_sharded_layers",
    "full_tensor",
    "local_tensor",
    "parallelize_layers",
    "shard_like",
    "sharded_loss_scope",
    "split_gradient_norms",
]
