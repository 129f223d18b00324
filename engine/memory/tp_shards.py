"""One tensor-parallel rank's share of a layer's weights, as meta shapes: what the memory
model counts per parameter without building DTensors (the replay itself runs the engine's
DTensor plans on a fake world: `traces.trace_stage`)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

__all__ = ["shard_for_tp"]


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
            if role == "shared_input":  # splits no weight: its Linears have roles of their own
                continue
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
