"""Sequence parallelism: what a layer's modules do on 1/tp of the sequence.

Under plain tensor parallelism every tp rank holds the whole residual stream between the
attention and MLP blocks, computes the same norms on it and all-reduces each row-wise output.
Under sequence parallelism (Megatron's, torch's `SequenceParallel`, torchtitan's Llama plan)
each tp rank holds its contiguous 1/tp of the sequence there instead: the row-wise layers
reduce-scatter along the sequence instead of all-reducing, the attention and the MLP all-gather
their (normed) input once, the vocabulary embedding reduce-scatters its output and the LM head
gathers its input. Norms and residual adds work token by token, so they run on the shard as
they are; the pipeline then exchanges each rank's shard as it stands.

A layer class says what its modules do under sequence parallelism in `sp_plan` (submodule →
role, beside its `tp_plan`): `sequence_norm` (a norm on the shard, its weight replicated: its
gradient is a partial sum over the tp ranks, which DTensor reduces when it is laid out as
the parameter), `sequence_gather` (a block that needs the whole sequence: attention, whose
rotary positions and causal mask are then the global ones, and the MLP's column-wise inputs),
`sequence_positions` (a learned position embedding looking up its shard's global positions).
A layer that declares no `sp_plan` is refused: a module it holds would take a shard for the
whole sequence.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ParallelStyle,
    PrepareModuleInput,
    SequenceParallel,
)

__all__ = ["SEQUENCE_ROLES", "SequencePositions", "sequence_plan", "sequence_style"]

SEQUENCE_ROLES = ("sequence_norm", "sequence_gather", "sequence_positions")
"""What a layer's `sp_plan` may say of a submodule."""


class SequencePositions(ParallelStyle):
    """A learned position embedding on the sequence shard: every tp rank looks up the global
    positions of its own 1/tp of the sequence (the table stays replicated; its gradient is a
    partial sum over the tp ranks, like a norm's)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(
            module,
            device_mesh,
            input_fn=_shard_positions,  # type: ignore[arg-type]  # torch types them as None
            output_fn=_local,  # type: ignore[arg-type]
        )


def _shard_positions(_module: nn.Module, inputs: tuple[object, ...], mesh: DeviceMesh) -> object:
    positions = inputs[0]
    assert isinstance(positions, torch.Tensor), "a position embedding takes a tensor"
    assert not isinstance(positions, DTensor), "positions arrive as a plain tensor"
    dim = positions.dim() - 1
    size = positions.shape[dim]
    if size % mesh.size():
        raise ValueError(
            f"a sequence of {size} positions does not split into {mesh.size()} equal shards: "
            f"use a sequence length that is a multiple of tp={mesh.size()} with "
            "--sequence-parallel"
        )
    mine = positions.chunk(mesh.size(), dim=dim)[mesh.get_local_rank()]
    return (DTensor.from_local(mine, mesh, [Shard(dim)], run_check=False), *inputs[1:])


def _local(_module: nn.Module, output: object, _mesh: DeviceMesh) -> object:
    return output.to_local() if isinstance(output, DTensor) else output


def sequence_style(role: str) -> ParallelStyle:
    """The torch style of one `sp_plan` role."""
    if role == "sequence_norm":
        return SequenceParallel(use_local_output=True)
    if role == "sequence_gather":
        return PrepareModuleInput(  # a DTensor in: the Linears' gradients sum, one scatter
            input_layouts=Shard(1), desired_input_layouts=Replicate(), use_local_output=False
        )
    if role == "sequence_positions":
        return SequencePositions()
    raise ValueError(
        f"unknown sequence-parallel role {role!r}: use one of {', '.join(SEQUENCE_ROLES)}"
    )


def sequence_plan(layer: nn.Module) -> dict[str, str]:
    """The layer's `sp_plan`, checked to cover every module holding replicated weights (those
    the `tp_plan` does not split): under sequence parallelism such a module sees a shard."""
    plan = getattr(layer, "sp_plan", None)
    kind = type(layer).__name__
    if plan is None:
        raise ValueError(
            f"layer {kind} declares no sp_plan (what its modules do on a sequence shard), so "
            "it cannot run under --sequence-parallel: give the class an sp_plan (an empty one "
            "if every module works token by token), or drop --sequence-parallel"
        )
    split = set(getattr(layer, "tp_plan", {})) | set(plan)
    for name, module in layer.named_modules():
        if not list(module.parameters(recurse=False)) or name in split:
            continue
        raise ValueError(
            f"{kind}.{name or '(itself)'} holds weights that neither its tp_plan nor its "
            "sp_plan places, and under --sequence-parallel it would see 1/tp of the sequence "
            "as if it were all of it: add it to the class's sp_plan (sequence_norm for a "
            "norm), or drop --sequence-parallel"
        )
    return dict(plan)
