"""ZeRO-3 through torch's FSDP2: every layer of a stage `fully_shard`ed over the stage's
data-parallel replicas, composed with the pipeline as torch.distributed.pipelining composes it.

Each layer's parameters live as fp32 shards (DTensors over the dp mesh); the first forward of
a step gathers a layer in the compute dtype and keeps it gathered for the step's other
micro-batches and for the backwards (no reshard after forward or backward), while gradients
accumulate unsharded without being reduced. After the stage's last backward of the step every
layer runs FSDP's post-backward with gradient sync on: one reduce-scatter in fp32 per layer,
and the layer is resharded. FSDP casts every parameter (norms and embeddings too), so the
arithmetic differs from autocast's and agrees with the reference to tolerance only.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

__all__ = ["FullyShardedLayers", "shard_layers"]


def shard_layers(
    layers: Iterable[nn.Module], mesh: DeviceMesh, dtype: torch.dtype
) -> list[FSDPModule]:
    """`fully_shard` each layer over `mesh` (1-D, the dp replicas): parameters gathered in
    `dtype`, gradients reduced in fp32; each layer is its own FSDP root, since a stage runs
    its layers one by one and never the stack's own forward."""
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    sharded: list[FSDPModule] = []
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy, reshard_after_forward=False)
        assert isinstance(layer, FSDPModule)
        sharded.append(layer)
    return sharded


class FullyShardedLayers:
    """The FSDP layers of one rank's stages and the per-step protocol that keeps them gathered
    across micro-batches and reduces their gradients once."""

    def __init__(self, layers: Sequence[FSDPModule]) -> None:
        self.layers = list(layers)

    def begin_step(self) -> None:
        """Micro-batch backwards accumulate unsharded gradients and keep the layers gathered."""
        for layer in self.layers:
            layer.set_requires_gradient_sync(False, recurse=False)
            layer.set_is_last_backward(False)
            layer.set_reshard_after_backward(False, recurse=False)

    def reduce_gradients(self) -> None:
        """After the stage's last backward: every layer's post-backward with sync on (its fp32
        reduce-scatter into the sharded `.grad`), then reshard."""
        for layer in self.layers:
            layer.set_is_last_backward(True)
            layer.set_reshard_after_backward(True, recurse=False)
            layer.set_requires_gradient_sync(True, recurse=False)
            state = fully_shard.state(layer)  # type: ignore[attr-defined]
            for each in state._state_ctx.all_states:
                for group in each._fsdp_param_groups:
                    group.post_backward()
            state._root_post_backward_final_callback()

    def reshard(self) -> None:
        """Free the gathered layers (after an evaluation: its forwards gathered them and no
        backward reshards), so the modules hold their shards again."""
        for layer in self.layers:
            layer.reshard()
