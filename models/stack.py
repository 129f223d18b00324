"""Materialising a slice of a layer list as one module with global parameter names."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from models.layers import LayerSpec, init_layer

__all__ = ["LayerStack", "build_layers", "lm_loss"]


class LayerStack(nn.Module):
    """Layers of a layer list run in order, named `layers.{global index}.…`.

    The same class holds a whole model (the single-process reference) or one stage, so
    parameter names are global whatever the partition.
    """

    def __init__(self, layers: Mapping[int, nn.Module]) -> None:
        super().__init__()
        self.indices: tuple[int, ...] = tuple(sorted(layers))
        self.layers = nn.ModuleDict({str(i): layers[i] for i in self.indices})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers.values():
            x = layer(x)
        return x


def build_layers(
    specs: Sequence[LayerSpec],
    indices: Iterable[int] | None = None,
    *,
    seed: int,
    device: torch.device | str = "cpu",
) -> LayerStack:
    """Build and initialise only the layers `indices` (all by default) of a layer list.

    Each layer is created on `meta`, given storage on `device` and initialised from
    (seed, global index), so no other layer's memory is ever touched. Tied layers built
    together share one parameter; built apart, each holds an identical copy.
    """
    chosen = list(range(len(specs))) if indices is None else sorted(set(indices))
    for i in chosen:
        if not 0 <= i < len(specs):
            raise ValueError(
                f"layer index {i} is out of range for a layer list of {len(specs)} layers: "
                f"use indices in [0, {len(specs)})"
            )
    layers: dict[int, nn.Module] = {}
    on_meta = torch.device(device).type == "meta"
    for i in chosen:
        module = specs[i].build("meta")
        if not on_meta:  # meta layers have shapes only: nothing to draw, nothing to allocate
            module = module.to_empty(device=device)
            init_layer(module, specs[i], seed=seed, index=i)
        layers[i] = module
    _share_tied(specs, layers)
    return LayerStack(layers)


def _share_tied(specs: Sequence[LayerSpec], layers: Mapping[int, nn.Module]) -> None:
    """Make tied layers that live in the same stack share the first one's parameter."""
    first: dict[str, nn.Parameter] = {}
    for i, module in layers.items():
        spec = specs[i]
        if spec.tie_key is None or spec.tied_param is None:
            continue
        parent_name, _, leaf = spec.tied_param.rpartition(".")
        parent = module.get_submodule(parent_name)
        if spec.tie_key in first:
            shared = first[spec.tie_key]
            if getattr(parent, leaf).shape != shared.shape:
                raise ValueError(
                    f"tied parameter {spec.tied_param!r} of layer {i} has shape "
                    f"{tuple(getattr(parent, leaf).shape)} but its tie group "
                    f"{spec.tie_key!r} has {tuple(shared.shape)}"
                )
            setattr(parent, leaf, shared)
        else:
            first[spec.tie_key] = getattr(parent, leaf)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy over all positions of a micro-batch."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))
