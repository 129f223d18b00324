"""Tensor parallelism inside a pipeline stage, through torch's DTensor plans.

Each layer class says how it splits (`tp_plan`: submodule → role); this module turns the roles
into `torch.distributed.tensor.parallel` styles on the mesh's `tp` dimension. Attention splits
by heads (q/k/v column-wise, the output projection row-wise), the MLP by its hidden size (up and
gate column-wise, down row-wise), the token embedding by vocabulary (row-wise) and the LM head by
vocabulary too (column-wise, logits left sharded on the vocabulary): the loss is taken on the
sharded logits under `loss_parallel`, so no rank ever holds the full logits. Norms, position
embeddings and row-wise biases stay replicated: every tp rank computes the same values for them.
They become replicated DTensors too (`distribute_module`, their inputs and outputs plain tensors
outside), so a stage's parameters are all DTensors on one mesh: the fused and foreach optimizer
kernels refuse a mix of DTensors and plain tensors in one call. Under sequence parallelism
(`engine.parallel.sequence_parallel`) the same roles reduce-scatter and all-gather along the
sequence instead, and each layer's `sp_plan` places its norms and position embeddings.

The helpers below are what the rest of the engine needs to treat a sharded parameter as the
whole it stands for: its full tensor (checkpoints keep global names and full shapes), a full
tensor cut to this rank's shard (loading), the local tensor (collectives over other groups), the
gradient norms counting every shard once, and the pipeline exchange of sequence shards.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from engine.comm.dtensor import is_dtensor
from models import LayerSpec, LayerStack, build_layers
from models.layers import init_layer

if TYPE_CHECKING:
    from torch.distributed.tensor import Placement
    from torch.distributed.tensor.parallel import ParallelStyle

__all__ = [
    "ROLES",
    "SequenceShards",
    "align_gradients",
    "as_gradient_of",
    "build_sharded_layers",
    "full_tensor",
    "local_tensor",
    "parallelize_layers",
    "shard_arriving_gradients",
    "shard_like",
    "sharded_loss_scope",
    "split_gradient_norms",
    "split_over_tp",
    "stage_layers",
]

ROLES = ("colwise", "rowwise", "vocab_embedding", "vocab_head", "shared_input")
"""What a layer's `tp_plan` may say of a submodule. `shared_input` marks a module whose
column-wise Linears read one input (attention's q, k and v; SwiGLU's gate and up): it arrives
there as one replicated DTensor, so their input gradients sum on each rank and one all-reduce
makes the sum whole, where each Linear's own would run one apiece (Megatron's single
all-reduce before a fused QKV)."""


def _style(role: str, sequence_parallel: bool = False) -> ParallelStyle:
    """The torch style of a role; under sequence parallelism the activations around the split
    layers are sequence shards (`Shard(1)`) instead of whole (`Replicate`)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
    )

    from engine.parallel.sequence_parallel import sequence_style

    around = Shard(1) if sequence_parallel else Replicate()
    if role == "colwise":
        return ColwiseParallel()  # under sequence parallelism its block gathers the input
    if role == "rowwise":
        return RowwiseParallel(output_layouts=around)
    if role == "vocab_embedding":
        return RowwiseParallel(input_layouts=Replicate(), output_layouts=around)
    if role == "vocab_head":
        return ColwiseParallel(
            input_layouts=around, output_layouts=Shard(-1), use_local_output=False
        )
    if role == "shared_input":
        return PrepareModuleInput(
            input_layouts=Replicate(), desired_input_layouts=Replicate(), use_local_output=False
        )
    if sequence_parallel:
        return sequence_style(role)
    raise ValueError(f"unknown tensor-parallel role {role!r}: use one of {', '.join(ROLES)}")


def parallelize_layers(
    layers: Sequence[nn.Module], tp_mesh: DeviceMesh, *, sequence_parallel: bool = False
) -> None:
    """Shard every layer in place by its class's `tp_plan` ("" is the layer itself), and with
    `sequence_parallel` by its `sp_plan` too (checked to place every replicated module).

    The layers hold their full, initialised weights (the same on every tp rank), so each rank
    keeps its slice of the very weights a single process starts from. A layer without a plan
    stays replicated. Ties are broken by the new parameters: the caller shares them again.
    """
    from torch.distributed.tensor import distribute_module
    from torch.distributed.tensor.parallel import parallelize_module

    from engine.parallel.sequence_parallel import sequence_plan

    for layer in layers:
        plan = dict(getattr(layer, "tp_plan", {}))
        if sequence_parallel:
            plan.update(sequence_plan(layer))
        for name, role in plan.items():
            target = layer if name == "" else layer.get_submodule(name)
            parallelize_module(target, tp_mesh, _style(role, sequence_parallel))
        for module in layer.modules():
            own = list(module.parameters(recurse=False))
            if any(not is_dtensor(p) for p in own):
                distribute_module(
                    module,
                    tp_mesh,
                    input_fn=_replicated,  # type: ignore[arg-type]  # torch types them as None
                    output_fn=_plain,  # type: ignore[arg-type]
                )


def _replicated(_module: nn.Module, inputs: tuple[object, ...], mesh: DeviceMesh) -> object:
    """A replicated module's plain inputs as replicated DTensors (the same on every tp rank)."""
    from torch.distributed.tensor import DTensor, Replicate

    return tuple(
        DTensor.from_local(x, mesh, [Replicate()], run_check=False)
        if isinstance(x, torch.Tensor) and not is_dtensor(x)
        else x
        for x in inputs
    )


def _plain(_module: nn.Module, output: object, _mesh: DeviceMesh) -> object:
    return output.to_local() if is_dtensor(output) else output


def build_sharded_layers(
    specs: Sequence[LayerSpec],
    indices: range,
    *,
    seed: int,
    device: torch.device | str,
    tp_mesh: DeviceMesh,
    sequence_parallel: bool = False,
) -> LayerStack:
    """The layers `indices`, split over `tp_mesh` before they get memory: built on `meta`,
    parallelized there, given storage for their shards only, then initialised per parameter
    from the same draws as one process (each rank keeps its slice). A rank never holds its
    stage's full weights, only one parameter's full draw at a time on the CPU."""
    stack = build_layers(specs, indices, seed=seed, device="meta")
    parallelize_layers(list(stack.layers.values()), tp_mesh, sequence_parallel=sequence_parallel)
    stack.to_empty(device=device)
    for i, layer in zip(stack.indices, stack.layers.values(), strict=True):
        init_layer(layer, specs[i], seed=seed, index=i, write=_write_slice)
    return stack


def stage_layers(
    specs: Sequence[LayerSpec],
    indices: range,
    *,
    seed: int,
    device: torch.device | str,
    built: LayerStack | None,
    tp_mesh: DeviceMesh | None,
    sequence_parallel: bool,
) -> LayerStack:
    """A stage's layers `indices` as its ranks hold them: `built` ones (split over `tp_mesh`
    here), or built and initialised on `device`, split before they get memory where there is
    a `tp_mesh`; either way gradients arriving at a split stage are sharded as its input."""
    if sequence_parallel and tp_mesh is None:
        raise ValueError(
            "sequence_parallel=True splits the sequence over tensor-parallel ranks, but "
            "the stage has none: use a mesh with tp > 1, or sequence_parallel=False"
        )
    if tp_mesh is None:
        return build_layers(specs, indices, seed=seed, device=device) if built is None else built
    if built is None:
        stack = build_sharded_layers(
            specs,
            indices,
            seed=seed,
            device=device,
            tp_mesh=tp_mesh,
            sequence_parallel=sequence_parallel,
        )
    else:
        parallelize_layers(
            list(built.layers.values()), tp_mesh, sequence_parallel=sequence_parallel
        )
        stack = built
    shard_arriving_gradients(stack)
    return stack


def _write_slice(param: nn.Parameter, values: torch.Tensor) -> None:
    local_tensor(param).copy_(shard_like(param, values))


def sharded_loss_scope(enabled: bool) -> contextlib.AbstractContextManager[None]:
    """Where the loss is taken on vocabulary-sharded logits, and where its backward runs:
    torch's `loss_parallel` (cross entropy over the shards, never gathering the logits)."""
    if not enabled:
        return contextlib.nullcontext()
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel()


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The part of `tensor` this rank holds: its local shard, or the tensor itself."""
    return tensor.to_local() if is_dtensor(tensor) else tensor


def as_gradient_of(param: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """A gradient computed on local tensors (the split backward's W GEMM) as `param`'s
    gradient: a DTensor laid out as the parameter, or the value itself."""
    if not is_dtensor(param) or is_dtensor(value):
        return value
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(value, param.device_mesh, param.placements, run_check=False)


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The whole of a sharded tensor (a collective over its tp group), or the tensor itself."""
    return tensor.full_tensor() if is_dtensor(tensor) else tensor


def shard_like(like: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """This rank's piece of `full`, cut as `like` is sharded (no communication: every rank
    holds `full`); `full` itself when `like` is a plain tensor."""
    if not is_dtensor(like):
        return full
    from torch.distributed.tensor import distribute_tensor

    cut = distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None)
    return cut.to_local()


def shard_arriving_gradients(module: nn.Module) -> None:
    """Lay each split parameter's gradient out as the parameter as soon as it arrives, before
    it is accumulated. DTensor's backward leaves the vocabulary-parallel embedding's gradient
    replicated: the whole vocabulary × d_model on every tp rank (Llama 3's 128,256 × 8,192 in
    fp32 is 4.2 GB) until `align_gradients` would cut it at the step's end. Replicate → Shard is
    a local slice, so the values are the same; only the bytes held differ."""
    for param in module.parameters():
        shard_arriving_gradient(param)


def shard_arriving_gradient(param: torch.Tensor) -> None:
    """`shard_arriving_gradients` for one parameter (nothing where tp does not split it)."""
    if is_dtensor(param) and any(p.is_shard() for p in param.placements):
        param.register_hook(
            functools.partial(_laid_out, param.device_mesh, tuple(param.placements))
        )


def _laid_out(mesh: DeviceMesh, placements: tuple[Placement, ...], grad: torch.Tensor) -> object:
    if is_dtensor(grad) and grad.placements != placements:
        return grad.redistribute(mesh, placements)
    return grad


def align_gradients(
    params: Sequence[nn.Parameter], *, then: Callable[[], None] = lambda: None
) -> None:
    """Lay every gradient out as its parameter is, then call `then` (the data-parallel sum).
    DTensor's backward may leave a sharded weight's gradient replicated (the vocabulary-
    parallel embedding's does); the optimizer, the data-parallel sum and tied-weight sums all
    work shard by shard. Replicate → Shard is a local cut, no communication."""
    for param in params:
        grad = param.grad
        if not is_dtensor(param) or not is_dtensor(grad):
            continue
        if grad.placements != param.placements:
            param.grad = grad.redistribute(param.device_mesh, param.placements)
    then()


def split_over_tp(tensor: torch.Tensor) -> bool:
    """Whether the tp ranks hold different slices of `tensor` (its norm sums over them), on a
    tp mesh or on ZeRO-3's (dp, tp) mesh, where every parameter is split over dp too."""
    if not is_dtensor(tensor):
        return False
    names = tensor.device_mesh.mesh_dim_names or ()
    return "tp" in names and tensor.placements[names.index("tp")].is_shard()


def split_gradient_norms(
    grads: Sequence[tuple[int, torch.Tensor]], size: int, device: torch.device
) -> torch.Tensor:
    """Per-parameter gradient norms at positions `0..size-1`, each shard counted once.

    A sharded gradient's norm is the root of the sum over the tp group of its shards' squared
    norms (one all-reduce for all of them); a replicated one is the same on every tp rank and
    is taken as it is.
    """
    whole = torch.zeros(size, dtype=torch.float32, device=device)
    squares = torch.zeros(size, dtype=torch.float32, device=device)
    group: dist.ProcessGroup | None = None
    for position, grad in grads:
        norm = torch.linalg.vector_norm(local_tensor(grad), 2.0).float()
        if split_over_tp(grad):
            assert is_dtensor(grad)
            squares[position] = norm * norm
            group = grad.device_mesh.get_group()
        else:
            whole[position] = norm
    if group is None:
        return whole
    dist.all_reduce(squares, group=group)
    return whole + squares.sqrt()


@dataclass(frozen=True)
class SequenceShards:
    """The pipeline exchange under tensor parallelism: every tp rank holds the same stage
    boundary tensor, so each sends only its 1/tp slice along the sequence to its counterpart
    on the next (or previous) stage, and the receivers all-gather the slices over tp."""

    group: dist.ProcessGroup
    rank: int
    size: int

    def outgoing(self, tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        for tensor in tensors:
            if tensor.dim() < 2 or tensor.shape[1] % self.size:
                raise ValueError(
                    f"a stage boundary tensor of shape {tuple(tensor.shape)} does not split "
                    f"into {self.size} equal sequence shards: use a sequence length that is a "
                    f"multiple of tp={self.size}"
                )
        return tuple(t.chunk(self.size, dim=1)[self.rank] for t in tensors)

    def incoming(self, tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        return tuple(self._gather(t) for t in tensors)

    def _gather(self, piece: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(piece) for _ in range(self.size)]
        dist.all_gather(parts, piece.detach().contiguous(), group=self.group)
        return torch.cat(parts, dim=1).requires_grad_(piece.requires_grad)
