"""ZeRO-3 for one rank's pipeline stages: what the engine, the measured step and the memory
replay all run, so that the three shard alike."""

from __future__ import annotations

import functools
from collections.abc import Sequence

from torch.distributed.device_mesh import DeviceMesh

from engine.parallel import FullyShardedLayers, fold_compute_gradients, shard_layers
from engine.runtime.precision import compute_dtype
from engine.runtime.stage import PipelineStage

__all__ = ["fully_shard_stages"]


def fully_shard_stages(
    stages: Sequence[PipelineStage],
    mesh: DeviceMesh | None,
    precision: str,
    *,
    pp_rank: int,
    reshard: Sequence[str],
) -> FullyShardedLayers:
    """Every layer of `stages` fully sharded over `mesh` (the dp replicas, `shard_layers`),
    gathered in `precision`'s compute dtype and given back as its stage's `reshard` says (one
    mode per stage); each stage drops its autocast weight copies and folds its Ws' gradients
    into FSDP's fp32 accumulation (`PipelineStage.fully_shard`)."""
    layers, modes = [], []
    for stage, mode in zip(stages, reshard, strict=True):
        own = list(stage.module.layers.values())
        stage.fully_shard(functools.partial(fold_compute_gradients, own))
        layers += own
        modes += [mode] * len(own)
    return shard_layers(layers, mesh, compute_dtype(precision), pp_rank=pp_rank, reshard=modes)
