"""The pp × dp × tp process grid, built from the launcher's environment.

By default ranks are laid out tp innermost, then dp, then pp outermost:
global rank = (pp_rank · dp + dp_rank) · tp + tp_rank. The tensor-parallel ranks of a stage,
which talk inside every layer, are consecutive (one host, fastest links); the replicas of a
stage follow; pipeline ranks, which exchange one activation per micro-batch, are furthest
apart. `--mesh-order` permutes the dimensions (outermost first); every rank computes its
peers through `rank_of` and `coordinates`, so nothing else depends on the order. Each pipeline
is one (dp_rank, tp_rank) column of the grid. Without a launcher (world size 1) the mesh is a
single process and no process group is created.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from engine.config import DEVICES, MESH_DIMS, parse_mesh_order

__all__ = [
    "Mesh",
    "check_device",
    "coordinates",
    "init_mesh",
    "launcher_world_size",
    "placement",
    "rank_of",
]


def launcher_world_size() -> int:
    """WORLD_SIZE as set by torchrun or the deepspeed launcher (1 when not launched)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def rank_of(
    *,
    pp_rank: int,
    dp_rank: int,
    tp_rank: int,
    dp: int,
    tp: int,
    pp: int | None = None,
    order: tuple[str, ...] = MESH_DIMS,
) -> int:
    """The global rank at grid coordinates (pp_rank, dp_rank, tp_rank), the dimensions laid
    out in `order` (outermost first; the outermost one's size is not needed)."""
    sizes = _sizes(pp, dp, tp, order)
    position = {"pp": pp_rank, "dp": dp_rank, "tp": tp_rank}
    rank = 0
    for dim in order:
        rank = rank * sizes[dim] + position[dim]
    return rank


def coordinates(
    rank: int, *, dp: int, tp: int, pp: int | None = None, order: tuple[str, ...] = MESH_DIMS
) -> tuple[int, int, int]:
    """(pp_rank, dp_rank, tp_rank) of a global rank: the inverse of `rank_of`."""
    sizes = _sizes(pp, dp, tp, order)
    position: dict[str, int] = {}
    for dim in reversed(order[1:]):
        rank, position[dim] = divmod(rank, sizes[dim])
    position[order[0]] = rank
    return position["pp"], position["dp"], position["tp"]


def _sizes(pp: int | None, dp: int, tp: int, order: tuple[str, ...]) -> dict[str, int]:
    """Each dimension's size; pp may be left out only where it is outermost."""
    assert tuple(sorted(order)) == tuple(sorted(MESH_DIMS)), f"not a mesh order: {order}"
    assert pp is not None or order[0] == "pp", f"rank order {order} needs the pp size"
    return {"pp": pp or 1, "dp": dp, "tp": tp}


@dataclass(frozen=True, kw_only=True)
class Mesh:
    """This rank's place in the grid and the groups it talks over."""

    pp: int
    """Pipeline ranks per replica."""
    dp: int
    """Data-parallel replicas."""
    rank: int
    """Global rank."""
    pp_rank: int
    """Position in the pipeline (which stage column)."""
    dp_rank: int
    """Which replica."""
    tp: int = 1
    """Tensor-parallel ranks per stage."""
    tp_rank: int = 0
    """Which slice of every layer of the stage this rank holds."""
    order: tuple[str, ...] = MESH_DIMS
    """The dimensions in global-rank order, outermost first (`--mesh-order`)."""
    device: torch.device
    """Where this rank computes."""
    backend: str | None = None
    """The process groups' backend, `nccl` or `gloo` (None in one process)."""
    pp_group: dist.ProcessGroup | None = None
    """The ranks of this pipeline (None in one process)."""
    dp_group: dist.ProcessGroup | None = None
    """The replicas of this stage (None in one process)."""
    tp_group: dist.ProcessGroup | None = None
    """The tensor-parallel ranks of this stage (None in one process)."""
    device_mesh: DeviceMesh | None = None
    """The DeviceMesh named `("pp", "dp", "tp")`, its dims in `order` (None in one process)."""

    @property
    def staged(self) -> bool:
        """Whether CUDA tensors travel through host memory: gloo cannot send them."""
        return self.device.type == "cuda" and self.backend == "gloo"

    @property
    def wire_device(self) -> torch.device:
        """Where tensors sent point to point live: the host when gloo carries CUDA tensors."""
        return torch.device("cpu") if self.staged else self.device

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.tp

    @property
    def tp_mesh(self) -> DeviceMesh | None:
        """The 1-D `tp` sub-mesh DTensor shards a stage's layers over (None without tp)."""
        return self.device_mesh["tp"] if self.device_mesh is not None and self.tp > 1 else None

    def columns(self) -> list[tuple[int, int]]:
        """Every pipeline of the grid as its (dp_rank, tp_rank), dp-major (the same list on
        every rank, whatever the mesh order)."""
        return [(d, t) for d in range(self.dp) for t in range(self.tp)]

    def global_rank(
        self, *, pp_rank: int, dp_rank: int | None = None, tp_rank: int | None = None
    ) -> int:
        """Global rank of a pipeline position in a column (this rank's column by default)."""
        return rank_of(
            pp_rank=pp_rank,
            dp_rank=self.dp_rank if dp_rank is None else dp_rank,
            tp_rank=self.tp_rank if tp_rank is None else tp_rank,
            dp=self.dp,
            tp=self.tp,
            pp=self.pp,
            order=self.order,
        )


def _check_layout(pp: int, dp: int, tp: int, world_size: int) -> None:
    if pp < 1 or dp < 1 or tp < 1:
        raise ValueError(f"pp={pp}, dp={dp} and tp={tp} must all be at least 1")
    if pp * dp * tp != world_size:
        raise ValueError(
            f"pp × dp × tp = {pp} × {dp} × {tp} = {pp * dp * tp} does not match the world size "
            f"{world_size}: launch {pp * dp * tp} processes or choose pp, dp and tp whose "
            f"product is {world_size}"
        )


def _group_options(backend: str, timeout: timedelta) -> object:
    """Backend options carrying the timeout (DeviceMesh subgroups ignore the default one)."""
    if backend == "nccl":
        options: object = dist.ProcessGroupNCCL.Options()
    else:
        options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    options._timeout = timeout  # type: ignore[attr-defined]
    return options


def _local_ranks() -> tuple[int, int]:
    """(this rank's index on its host, ranks on its host), from the launcher's environment."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE") or 1)
    return local_rank, max(local_ranks, local_rank + 1)


def _no_cuda(what: str) -> ValueError:
    return ValueError(
        f"{what} needs CUDA and this machine has no GPU: run on the CPU (--device cpu, gloo), "
        "or launch on a GPU host"
    )


def check_device(device: str) -> None:
    """Refuse a device this machine cannot place ranks on: an unknown name, or `cuda` without
    CUDA. Launchers call it before starting ranks; `init_mesh` calls it in every rank."""
    if device not in DEVICES:
        raise ValueError(f"unknown device {device!r}: choose one of {', '.join(DEVICES)}")
    if device == "cuda" and not torch.cuda.is_available():
        raise _no_cuda("--device cuda")


def placement(backend: str | None, device: str) -> tuple[torch.device, str]:
    """Where this rank computes and which backend carries its traffic.

    `auto`: CUDA with NCCL when the host has a GPU for each of its ranks (NCCL needs one per
    rank), otherwise the CPU with gloo; an explicit `backend="gloo"` means the CPU, and an
    explicit `nccl` refuses to fall back. `cuda`: GPUs even when ranks share them, over gloo,
    which cannot send CUDA tensors, so the exchange stages them through host memory. `cpu`.
    """
    check_device(device)
    cpu = torch.device("cpu")
    if device == "cpu" or (device == "auto" and backend == "gloo"):
        if backend == "nccl":
            raise ValueError("backend nccl needs CUDA: use gloo on the CPU, or --device cuda")
        return cpu, "gloo"
    if not torch.cuda.is_available():
        if backend == "nccl":
            raise _no_cuda("backend nccl")
        return cpu, "gloo"
    local_rank, local_ranks = _local_ranks()
    devices = torch.cuda.device_count()
    if local_ranks <= devices:
        return torch.device("cuda", local_rank), backend or "nccl"
    message = (
        f"{local_ranks} ranks on this host but {devices} CUDA device(s): NCCL needs one GPU per "
        "rank"
    )
    if backend == "nccl":
        raise ValueError(
            f"{message}; launch one rank per GPU ({devices} per host), or let ranks share GPUs "
            "over gloo (--device cuda), or run on the CPU (--device cpu)"
        )
    if device == "cuda":
        return torch.device("cuda", local_rank % devices), "gloo"
    if local_rank == 0:  # once per host, not once per rank
        warnings.warn(
            f"{message}: running on the CPU with gloo (--device cuda shares the GPUs instead, "
            "over gloo through host memory)",
            stacklevel=3,
        )
    return cpu, "gloo"


def _device_mesh(
    place: torch.device,
    sizes: dict[str, int],
    dims: tuple[str, ...],
    backend: str,
    timeout: timedelta,
) -> DeviceMesh:
    """The named DeviceMesh with its dims in rank order: its rank tensor, arange(world)
    shaped by the sizes in `dims` order, is then the map `rank_of` computes."""
    override = {dim: (backend, _group_options(backend, timeout)) for dim in dims}
    return init_device_mesh(
        place.type,
        tuple(sizes[dim] for dim in dims),
        mesh_dim_names=dims,
        backend_override=override,  # type: ignore[arg-type]
    )


def init_mesh(
    pp: int,
    dp: int = 1,
    tp: int = 1,
    *,
    timeout_s: float = 300.0,
    backend: str | None = None,
    device: str = "auto",
    order: str | tuple[str, ...] = MESH_DIMS,
) -> Mesh:
    """Join the launcher's process group and build the named pp × dp × tp grid.

    `device` says where ranks compute (see `placement`): by default CUDA with NCCL when the
    host has a GPU for each of its ranks, otherwise the CPU with gloo (four local ranks on a
    one-GPU laptop run on its CPU, with a warning); `cuda` lets ranks share the GPUs over gloo.
    `order` lays the dimensions out in the global rank, outermost first (`pp,dp,tp`).

    Every group gets `timeout_s`, so a dead or stalled peer raises instead of hanging.
    """
    dims = parse_mesh_order(order)
    world_size = launcher_world_size()
    _check_layout(pp, dp, tp, world_size)
    place, backend = placement(backend, device)
    if place.type == "cuda":
        torch.cuda.set_device(place)
    if world_size == 1:
        return Mesh(pp=1, dp=1, rank=0, pp_rank=0, dp_rank=0, order=dims, device=place)
    timeout = timedelta(seconds=timeout_s)
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=timeout)
    device_mesh = _device_mesh(place, {"pp": pp, "dp": dp, "tp": tp}, dims, backend, timeout)
    rank = dist.get_rank()
    pp_rank, dp_rank, tp_rank = coordinates(rank, dp=dp, tp=tp, pp=pp, order=dims)
    return Mesh(
        order=dims,
        pp=pp,
        dp=dp,
        tp=tp,
        rank=rank,
        pp_rank=pp_rank,
        dp_rank=dp_rank,
        tp_rank=tp_rank,
        device=place,
        backend=backend,
        pp_group=device_mesh.get_group("pp"),
        dp_group=device_mesh.get_group("dp"),
        tp_group=device_mesh.get_group("tp"),
        device_mesh=device_mesh,
    )
