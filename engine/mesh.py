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

__all__ = ["Mesh", "init_mesh", "launcher_world_size"]


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
    pp_group: dist.ProcessGroup | None = None
    """The ranks of this pipeline (None in one process)."""
    dp_group: dist.ProcessGroup | None = None
    """The replicas of this stage (None in one process)."""
    device_mesh: DeviceMesh | None = None
    """The named `("dp", "pp")` DeviceMesh (None in one process)."""

    @property
    def world_size(self) -> int:
        return self.pp * self.dp

    def global_rank(self, *, pp_rank: int, dp_rank: int | None = None) -> int:
        """Global rank of a pipeline position in a replica (this replica by default)."""
        replica = self.dp_rank if dp_rank is None else dp_rank
        return replica * self.pp + pp_rank

    @property
    def prev_rank(self) -> int | None:
        return self.global_rank(pp_rank=self.pp_rank - 1) if self.pp_rank > 0 else None

    @property
    def next_rank(self) -> int | None:
        last = self.pp_rank == self.pp - 1
        return None if last else self.global_rank(pp_rank=self.pp_rank + 1)


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


def _uses_cuda(backend: str | None) -> bool:
    """CUDA when this host has a GPU for each of its ranks (NCCL needs one per rank); otherwise
    gloo on the CPU, which an explicit `backend="nccl"` refuses instead of falling back to."""
    if backend == "gloo":
        return False
    if not torch.cuda.is_available():
        if backend == "nccl":
            raise ValueError(
                "backend nccl needs CUDA and this machine has no GPU: run on the CPU with the "
                "gloo backend (or leave the backend unset), or launch on a GPU host"
            )
        return False
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE") or 1)
    local_ranks = max(local_ranks, local_rank + 1)
    devices = torch.cuda.device_count()
    if local_ranks <= devices:
        return True
    message = (
        f"{local_ranks} ranks on this host but {devices} CUDA device(s): NCCL needs one GPU per "
        "rank"
    )
    if backend == "nccl":
        raise ValueError(
            f"{message}; launch one rank per GPU ({devices} per host), or use the gloo backend "
            "to run on the CPU"
        )
    if local_rank == 0:  # once per host, not once per rank
        warnings.warn(f"{message}: running on the CPU with gloo", stacklevel=3)
    return False


def init_mesh(
    pp: int, dp: int = 1, *, timeout_s: float = 300.0, backend: str | None = None
) -> Mesh:
    """Join the launcher's process group and build the named pp × dp grid.

    Ranks compute on CUDA (NCCL) when the host has a GPU for each of its ranks, otherwise on the
    CPU (gloo): four local ranks on a one-GPU laptop run on its CPU, with a warning.

    Every group gets `timeout_s`, so a dead or stalled peer raises instead of hanging.
    """
    world_size = launcher_world_size()
    _check_layout(pp, dp, world_size)
    use_cuda = _uses_cuda(backend)
    if use_cuda:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    if world_size == 1:
        return Mesh(pp=1, dp=1, rank=0, pp_rank=0, dp_rank=0, device=device)
    backend = backend or ("nccl" if use_cuda else "gloo")
    timeout = timedelta(seconds=timeout_s)
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=timeout)
    override = {dim: (backend, _group_options(backend, timeout)) for dim in ("dp", "pp")}
    device_mesh = init_device_mesh(
        device.type,
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
        device=device,
        pp_group=device_mesh.get_group("pp"),
        dp_group=device_mesh.get_group("dp"),
        device_mesh=device_mesh,
    )
