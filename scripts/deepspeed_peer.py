"""The same layer list as a DeepSpeed `PipelineModule`: the peer meshpipe is measured against.

Each DeepSpeed layer wraps one of our layers, built and initialised exactly as meshpipe builds
it (seed, global index), so both engines start from the same weights and see the same data; a
loss-curve or throughput difference is the engines', not the models'. Needs `deepspeed`
(`pip install 'meshpipe[deepspeed]'`); nothing else in meshpipe imports this module.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from engine.runtime.micro_batches import LossFn, split_micro_batches
from models import LayerSpec, build_layers, lm_loss

__all__ = ["MeshpipeLayer", "deepspeed_pipeline", "micro_batch_iterator"]


class MeshpipeLayer(nn.Module):
    """Layer `index` of a layer list, initialised as meshpipe initialises it."""

    def __init__(self, specs: Sequence[LayerSpec], index: int, seed: int) -> None:
        super().__init__()
        self.inner = build_layers(specs, [index], seed=seed).layers[str(index)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


def deepspeed_pipeline(
    specs: Sequence[LayerSpec],
    *,
    num_stages: int,
    seed: int,
    partition_method: str = "uniform",
    loss_fn: LossFn = lm_loss,
    activation_checkpoint_interval: int = 0,
) -> Any:
    """A `deepspeed.pipe.PipelineModule` of our layers (tied weights are not supported)."""
    from deepspeed.pipe import LayerSpec as DeepSpeedLayerSpec
    from deepspeed.pipe import PipelineModule

    if any(spec.tie_key is not None for spec in specs):
        raise ValueError(
            "deepspeed_pipeline builds untied models only: DeepSpeed ties weights through its "
            "own TiedLayerSpec; use a model with tie_embeddings=False"
        )
    layers = [DeepSpeedLayerSpec(MeshpipeLayer, specs, i, seed) for i in range(len(specs))]
    return PipelineModule(
        layers=layers,
        num_stages=num_stages,
        loss_fn=loss_fn,
        partition_method=partition_method,
        activation_checkpoint_interval=activation_checkpoint_interval,
    )


def micro_batch_iterator(
    batches: Sequence[tuple[torch.Tensor, torch.Tensor]], micro_batches: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """DeepSpeed's `train_batch` pulls micro-batches from an iterator, in step order."""
    for inputs, targets in batches:
        yield from zip(
            split_micro_batches(inputs, micro_batches),
            split_micro_batches(targets, micro_batches),
            strict=True,
        )
