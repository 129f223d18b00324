"""The pp × dp process grid, built from the launcher's environment.

Ranks are laid out replica-major: global rank = dp_rank · pp + pp_rank, so the stages of one
pipeline are consecutive ranks (on one host when a host runs a whole pipeline). Without a
launcher (world size 1) the mesh is a single process and no process group is created.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from engine.config import DEVICES

__all__ = ["Mesh", "check_device", "init_mesh", "launcher_world_size", "placement"]


def launcher_world_size() -> int:
    """WORLD_SIZE as set by torchrun or the deepspeed launcher (1 when not launched)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


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
    device: torch.device
    """Where this rank computes."""
    backend: str | None = None
    """The process groups' backend, `nccl` or `gloo` (None in one process)."""
    pp_group: dist.ProcessGroup | None = None
    """The ranks of this pipeline (None in one process)."""
    dp_group: dist.ProcessGroup | None = None
    """The replicas of this stage (None in one process)."""
    device_mesh: DeviceMesh | None = None
    """The named `("dp", "pp")` DeviceMesh (None in one process)."""

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
        return self.pp * self.dp

    def global_rank(self, *, pp_rank: int, dp_rank: int | None = None) -> int:
        """Global rank of a pipeline position in a replica (this replica by default)."""
        replica = self.dp_rank if dp_rank is None else dp_rank
        return replica * self.pp + pp_rank


def _check_layout(pp: int, dp: int, world_size: int) -> None:
    if pp < 1 or dp < 1:
        raise ValueError(f"pp={pp} and dp={dp} must both be at least 1")
    if pp * dp != world_size:
        raise ValueError(
            f"pp × dp = {pp} × {dp} = {pp * dp} does not match the world size {world_size}: "
            f"launch {pp * dp} processes or choose pp and dp whose product is {world_size}"
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


def init_mesh(
    pp: int,
    dp: int = 1,
    *,
    timeout_s: float = 300.0,
    backend: str | None = None,
    device: str = "auto",
) -> Mesh:
    """Join the launcher's process group and build the named pp × dp grid.

    `device` says where ranks compute (see `placement`): by default CUDA with NCCL when the
    host has a GPU for each of its ranks, otherwise the CPU with gloo (four local ranks on a
    one-GPU laptop run on its CPU, with a warning); `cuda` lets ranks share the GPUs over gloo.

    Every group gets `timeout_s`, so a dead or stalled peer raises instead of hanging.
    """
    world_size = launcher_world_size()
    _check_layout(pp, dp, world_size)
    place, backend = placement(backend, device)
    if place.type == "cuda":
        torch.cuda.set_device(place)
    if world_size == 1:
        return Mesh(pp=1, dp=1, rank=0, pp_rank=0, dp_rank=0, device=place)
    timeout = timedelta(seconds=timeout_s)
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=timeout)
    override = {dim: (backend, _group_options(backend, timeout)) for dim in ("dp", "pp")}
    device_mesh = init_device_mesh(
        place.type,
        (dp, pp),
        mesh_dim_names=("dp", "pp"),
        backend_override=override,  # type: ignore[arg-type]
    )
    rank = dist.get_rank()
    return Mesh(
        pp=pp,
        dp=dp,
        rank=rank,
        pp_rank=rank % pp,
        dp_rank=rank // pp,
        device=place,
        backend=backend,
        pp_group=device_mesh.get_group("pp"),
        dp_group=device_mesh.get_group("dp"),
        device_mesh=device_mesh,
    )
