"""One rank's data- and tensor-parallel groups for a measured step, in one process.

A stage's replicas (dp) and tensor-parallel ranks (tp) are a `dp × tp` grid. To measure one
rank's step, `stage_grid` joins torch's fake process group (`dist.init_process_group("fake")`)
as rank 0 of a world of `dp · tp`: every collective returns at once without peers or data, but
FSDP2, DTensor and the ZeRO buffers allocate exactly as they do against real peers, so their
real code runs under the tracker. Rank 0 holds the largest shard wherever shards differ (FSDP2
and the flat buffers pad the last ones). Inside a launched world of `dp · tp` ranks (a gloo
test), the grid is built on it instead, so the same measurement runs against real peers.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore

__all__ = ["StageGrid", "stage_grid"]


@dataclass(frozen=True, kw_only=True)
class StageGrid:
    """The meshes one rank's stage is sharded over (None where that dimension is 1)."""

    dp: int
    tp: int
    dp_mesh: DeviceMesh | None
    tp_mesh: DeviceMesh | None
    dp_rank: int = 0

    @property
    def dp_group(self) -> dist.ProcessGroup | None:
        return None if self.dp_mesh is None else self.dp_mesh.get_group()


@contextlib.contextmanager
def stage_grid(dp: int, tp: int, *, device: str = "cpu", fsdp: bool = False) -> Iterator[StageGrid]:
    """A `dp × tp` grid for one rank: on a fake world made here (and torn down after), on
    the launched world when it has `dp · tp` ranks, or none at all when `dp · tp` is 1 and
    `fsdp` is not asked for (FSDP2 shards over a dp mesh even of one rank, as the engine's
    ZeRO-3 at pp > 1 and dp 1 does)."""
    if dp * tp == 1 and not fsdp:
        yield StageGrid(dp=1, tp=1, dp_mesh=None, tp_mesh=None)
        return
    made = not dist.is_initialized()
    if made:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=dp * tp)
    elif dist.get_world_size() != dp * tp:
        raise ValueError(
            f"measuring dp={dp} × tp={tp} needs a world of {dp * tp} ranks (or none: one "
            f"process joins a fake one), but this process is in one of {dist.get_world_size()}"
        )
    try:
        mesh = init_device_mesh(device, (dp, tp), mesh_dim_names=("dp", "tp"))
        yield StageGrid(
            dp=dp,
            tp=tp,
            dp_mesh=mesh["dp"] if dp > 1 or fsdp else None,
            tp_mesh=mesh["tp"] if tp > 1 else None,
            dp_rank=mesh.get_local_rank("dp"),
        )
    finally:
        if made:
            dist.destroy_process_group()
