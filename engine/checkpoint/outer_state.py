"""DiLoCo's outer optimizer state in a checkpoint: one momentum buffer per parameter.

Checkpoints of a semi-synchronous run are taken right after a meeting (the config refuses
other save steps), when every replica holds the same weights, which are then the weights of
the last meeting too, and the same outer momentum. So the first replica of each stage writes
`outer-stageSSS.safetensors` under the parameters' global names (any layout loads it) and
rank 0 indexes them in `outer.safetensors.index.json`, which the manifest covers.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from engine.checkpoint.files import ShardRecord, TensorReader, canonical_name, write_index
from engine.checkpoint.manifest import verify_manifest
from engine.comm.dtensor import is_dtensor
from engine.parallel import ReplicaMeetings, full_tensor, local_tensor, shard_like
from models import LayerSpec

__all__ = ["OUTER_INDEX", "outer_tensors", "read_outer_momenta", "write_outer_index"]

OUTER_INDEX = "outer.safetensors.index.json"


def outer_tensors(
    module: nn.Module, specs: Sequence[LayerSpec], meetings: ReplicaMeetings | None
) -> dict[str, torch.Tensor]:
    """A stage's outer momentum buffers under stored names, whole (every tp rank calls this:
    a tensor-parallel buffer is gathered over its tp group)."""
    momenta = meetings.momenta() if meetings is not None else {}
    stored = {}
    for name, param in module.named_parameters():
        if canonical_name(specs, name) != name or id(param) not in momenta:
            continue
        buffer = momenta[id(param)]
        if is_dtensor(param):
            from torch.distributed.tensor import DTensor

            buffer = DTensor.from_local(buffer, param.device_mesh, param.placements)
        stored[name] = full_tensor(buffer)
    return stored


def write_outer_index(directory: Path, records: Sequence[ShardRecord], step: int) -> None:
    """Rank 0: the index of every stage's outer shard (none without DiLoCo momentum)."""
    if records:
        write_index(directory / OUTER_INDEX, records, {"step": step})


def read_outer_momenta(
    modules: Sequence[nn.Module], specs: Sequence[LayerSpec], directory: Path
) -> dict[int, torch.Tensor] | None:
    """This rank's outer momentum buffers (local shards, by parameter `id`), checked against
    the manifest and the index; None when the checkpoint holds none."""
    if not (directory / OUTER_INDEX).is_file():
        return None
    verify_manifest(directory, (OUTER_INDEX,))
    reader = TensorReader(directory, OUTER_INDEX)
    momenta = {}
    for module in modules:
        for name, param in module.named_parameters():
            stored = canonical_name(specs, name)
            if stored in reader.names:
                momenta[id(param)] = local_tensor(shard_like(param, reader.get(stored)))
    return momenta
