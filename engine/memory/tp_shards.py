"""One tensor-parallel rank's share of a layer, as meta shapes the replay can run, and under
sequence parallelism the same rank's sequence shards between its blocks."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

__all__ = ["shard_for_tp", "shard_sequence_for_tp"]


def shard_for_tp(layers: Iterable[nn.Module], tp: int) -> None:
    """Cut each weight a layer's `tp_plan` splits to one tp rank's shard, on meta.

    A tensor-parallel rank computes exactly its layers with these local shapes (the
    attention's head counts follow its projections), so the replay runs one rank's share of a
    stage through the same code without DTensor or peers: column-wise and vocabulary splits
    cut the output rows (and a column-wise bias), row-wise ones the input columns (its bias is
    replicated). The all-reduces that make a row-wise output whole write into a tensor of the
    size the replay allocates.
    """
    if tp == 1:
        return
    for layer in layers:
        for name, role in getattr(layer, "tp_plan", {}).items():
            target = layer if name == "" else layer.get_submodule(name)
            weight = target.weight
            assert isinstance(weight, nn.Parameter), f"{name} of a tp_plan has no weight"
            rows, cols = weight.shape[0], weight.shape[1]
            by_rows = role != "rowwise"
            shape = (rows // tp, cols) if by_rows else (rows, cols // tp)
            target.weight = nn.Parameter(torch.empty(shape, device="meta"))
            bias = getattr(target, "bias", None)
            if by_rows and isinstance(bias, nn.Parameter):
                target.bias = nn.Parameter(torch.empty(bias.shape[0] // tp, device="meta"))


def shard_sequence_for_tp(layers: Iterable[nn.Module], tp: int) -> None:
    """Under sequence parallelism, make one rank's layers hold what its collectives leave it:
    the activations between blocks as 1/tp of the sequence.

    Hooks stand in for the collectives, allocating what each one returns on a rank: a new
    sequence shard out of every row-wise and vocabulary-embedding output (the reduce-scatter),
    the whole sequence again into every `sequence_gather` block and the LM head (the
    all-gather, kept for the backward of the layers it feeds), and a learned position table
    asked for its shard's positions only. Norms and residual adds then run on the shard as on
    a rank. Shapes and bytes only: no rank's values.
    """
    if tp == 1:
        return
    for layer in layers:
        plan = {**getattr(layer, "tp_plan", {}), **getattr(layer, "sp_plan", {})}
        for name, role in plan.items():
            target = layer if name == "" else layer.get_submodule(name)
            if role in ("rowwise", "vocab_embedding"):
                target.register_forward_hook(_scatter(tp))
            elif role in ("vocab_head", "sequence_gather"):
                target.register_forward_pre_hook(_gather(tp))
            elif role == "sequence_positions":
                target.register_forward_pre_hook(_positions(tp))


def _scatter(tp: int) -> Callable[[nn.Module, object, torch.Tensor], torch.Tensor]:
    def hook(_module: nn.Module, _inputs: object, output: torch.Tensor) -> torch.Tensor:
        return output[:, : output.shape[1] // tp].clone()

    return hook


def _gather(tp: int) -> Callable[[nn.Module, tuple[torch.Tensor, ...]], tuple[torch.Tensor, ...]]:
    def hook(_module: nn.Module, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        return (inputs[0].repeat(1, tp, 1), *inputs[1:])

    return hook


def _positions(
    tp: int,
) -> Callable[[nn.Module, tuple[torch.Tensor, ...]], tuple[torch.Tensor, ...]]:
    def hook(_module: nn.Module, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        positions = inputs[0]
        return (positions[..., : positions.shape[-1] // tp], *inputs[1:])

    return hook
