"""ZeRO-3 through torch's FSDP2: every layer of a stage `fully_shard`ed over the stage's
data-parallel replicas, composed with the pipeline as torch.distributed.pipelining composes it.

Each layer's parameters live as fp32 shards (DTensors over the dp mesh); the first forward of
a step gathers a layer in the compute dtype and keeps it gathered for the step's other
micro-batches and for the backwards (no reshard after forward or backward), while gradients
accumulate unsharded without being reduced. After the stage's last backward of the step every
layer runs FSDP's post-backward with gradient sync on: one reduce-scatter in fp32 per layer,
and the layer is resharded. `--zero-reshard micro-batch` (on the stages
`--zero-reshard-stages` names, all by default) leaves FSDP its own protocol instead:
gathered for each forward and backward, reduce-scattered after each backward. FSDP casts every
parameter (norms and embeddings too), so the arithmetic differs from autocast's and agrees with
the reference to tolerance only.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from engine.comm.dtensor import is_dtensor
from engine.parallel.tensor_parallel import shard_arriving_gradient

if TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule

__all__ = ["FullyShardedLayers", "check_unshared", "fold_compute_gradients", "shard_layers"]


def _quiet_view_warnings() -> None:
    """FSDP2 warns when a layer returns a view (a norm under fake tensors, DTensor's local
    outputs), since an in-place op on it would skip the pre-backward hook. meshpipe's layers
    and stages never modify a layer's output in place (residuals add out of place, sends
    detach), so for its own layers the warning only alarms; it stays for any other module.
    Set when layers are sharded (adding the same filter again replaces it)."""
    warnings.filterwarnings(
        "ignore",
        message=r"FSDP2-wrapped module \(FSDP(GPT|Llama)\w*\) returned a view tensor",
        category=UserWarning,
    )


def shard_layers(
    layers: Sequence[nn.Module],
    mesh: DeviceMesh | None,
    dtype: torch.dtype,
    *,
    pp_rank: int,
    reshard: Sequence[str] | None = None,
) -> FullyShardedLayers:
    """`fully_shard` each layer over `mesh` (1-D, the dp replicas): parameters gathered in
    `dtype`, gradients summed over the replicas in fp32 (FSDP's default is the mean, but each
    micro-batch loss is already divided by micro-batches × replicas, as the reference's is,
    and the other ZeRO levels sum); each layer is its own FSDP root, since a stage runs
    its layers one by one and never the stack's own forward. `reshard`, one per layer, is when
    it gives its gathered weights back: after the step (`step`, all by default) or after each
    forward and backward (`micro-batch`, FSDP's own per-backward reduce-scatter)."""
    if mesh is None:
        raise ValueError(
            "zero=3 shards every layer over the data-parallel replicas with FSDP2, which "
            "needs torch.distributed: launch the run (meshpipe train, torchrun), or use "
            "zero=0, 1 or 2 in one process"
        )
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    check_unshared(layers, pp_rank)
    _quiet_view_warnings()
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    modes = ["step"] * len(layers) if reshard is None else list(reshard)
    sharded: list[FSDPModule] = []
    for layer, mode in zip(layers, modes, strict=True):
        per_micro_batch = mode == "micro-batch"
        split = any(is_dtensor(p) for p in layer.parameters())  # over tp, before FSDP
        fully_shard(layer, mesh=mesh, mp_policy=policy, reshard_after_forward=per_micro_batch)
        assert isinstance(layer, FSDPModule)
        layer.set_gradient_divide_factor(1.0)
        layer.set_force_sum_reduction_for_comms(True)
        if split:
            layer.register_forward_pre_hook(_shard_gathered_gradients)
        sharded.append(layer)
    _one_reduce_scatter_in_flight(sharded)
    return FullyShardedLayers(sharded, per_micro_batch=[m == "micro-batch" for m in modes])


def _one_reduce_scatter_in_flight(layers: Sequence[FSDPModule]) -> None:
    """FSDP keeps a reduce-scatter's input until the next one of its communication context
    starts (or the backward ends), and one context is shared under a root. Here each layer is
    its own root, so a stage's backward per micro-batch would hold every layer's fp32 input
    at once, as much as the unsharded gradients resharding per micro-batch is meant to save.
    The layers share one list of those inputs, so the next layer's reduce-scatter frees the
    last one's, as under one root (contexts exist once lazily initialised)."""
    from torch.distributed.fsdp import fully_shard

    in_flight: list[object] = []
    for layer in layers:
        state = fully_shard.state(layer)  # type: ignore[attr-defined]
        state._lazy_init()
        state._comm_ctx.reduce_scatter_states = in_flight


_HOOKED = "_meshpipe_shards_arriving_gradients"
"""Marks a gathered parameter whose gradient hook is registered (FSDP2 keeps one per layer
parameter, refilled at each gather)."""


def _shard_gathered_gradients(layer: nn.Module, _args: object) -> None:
    """Under tp, the parameters FSDP gathers for a forward (its pre-forward hook runs first) are
    DTensors over tp, and DTensor's backward hands the vocabulary-parallel embedding's gradient
    to them replicated: the whole vocabulary × d_model, held until the reduce-scatter. Each
    gets `shard_arriving_gradient` once, as the engine's stage gives its own parameters
    without ZeRO-3, so a rank holds its shard from the start."""
    for param in layer.parameters():
        if not getattr(param, _HOOKED, False):
            shard_arriving_gradient(param)
            setattr(param, _HOOKED, True)


def fold_compute_gradients(layers: Sequence[nn.Module]) -> None:
    """Add the compute-dtype gradients a split backward left on `layers`' gathered parameters
    into FSDP's fp32 accumulation, as FSDP's post-backward does for autograd's (the I and W
    halves assign some outside autograd, after it or without it)."""
    from torch.distributed.fsdp import fully_shard

    for layer in layers:
        for group in fully_shard.state(layer)._fsdp_param_groups:  # type: ignore[attr-defined]
            for param in group.fsdp_params:
                param.accumulate_unsharded_grad_if_needed()
                param.to_accumulated_grad_if_needed()


def check_unshared(layers: Sequence[nn.Module], pp_rank: int) -> None:
    """ZeRO-3 shards each layer on its own: a weight two layers of one rank share (a tie held
    in one rank) would be sharded twice."""
    owner: dict[int, int] = {}
    for index, layer in enumerate(layers):
        for param in layer.parameters():
            if owner.setdefault(id(param), index) != index:
                raise ValueError(
                    f"zero=3 shards every layer on its own, but two layers on pipeline rank "
                    f"{pp_rank} share a tied weight (such as GPT's embedding and head in one "
                    "rank's stages): place them on different pipeline ranks (more --pp, "
                    "another --partition or no V-shaped placement), untie them, or use --zero 2"
                )


class FullyShardedLayers:
    """The FSDP layers of one rank's stages and the per-step protocol of each: kept gathered
    across micro-batches with gradients reduced once, or (`per_micro_batch`) FSDP's own
    protocol of a gather per forward and backward and a reduce-scatter after each backward,
    whose sharded gradients FSDP sums over the step's micro-batches."""

    def __init__(
        self, layers: Sequence[FSDPModule], *, per_micro_batch: Sequence[bool] | None = None
    ) -> None:
        self.layers = list(layers)
        flags = [False] * len(self.layers) if per_micro_batch is None else per_micro_batch
        pairs = list(zip(self.layers, flags, strict=True))
        self.kept = [layer for layer, flag in pairs if not flag]
        """The layers kept gathered for the step."""
        self.resharded = [layer for layer, flag in pairs if flag]
        """The layers that run FSDP's own protocol, resharded per micro-batch."""

    def begin_step(self) -> None:
        """Micro-batch backwards accumulate unsharded gradients and keep the layers gathered
        (nothing to change for a layer whose every backward reduces and reshards)."""
        for layer in self.kept:
            layer.set_requires_gradient_sync(False, recurse=False)
            layer.set_is_last_backward(False)
            layer.set_reshard_after_backward(False, recurse=False)

    def reduce_gradients(self) -> None:
        """After the stage's last backward: every layer's post-backward with sync on (its fp32
        reduce-scatter into the sharded `.grad`), then reshard. Per micro-batch, each backward
        has done so already."""
        from torch.distributed.fsdp import fully_shard

        for layer in self.kept:
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
