"""FSDP2's collectives for a step measured on real ranks: every buffer the tracker counts is
freed by the measuring thread, at the same point of the step in every run.

A gloo (or NCCL) work keeps the tensors it was given until the backend's own thread lets the
finished work go, which is sometimes after the step's thread has dropped them: the buffer is
then freed late, by that thread, and a measurement taken meanwhile counts it. On two gloo ranks
FSDP2's 32 KiB all-gather buffer of llama-tiny outlived the first forward in about 4 % of
measured steps. Here each collective runs on untracked copies of FSDP's buffers, which the
backend may free whenever it likes, and FSDP's own buffers live exactly as long as FSDP holds
them, as on torch's fake process group, whose works finish before they return. The allocator's
peak of a step measured so includes the copies (one layer's buffers at a time); the fake
world's, which `meshpipe memory --measure` reports, does not.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
from torch.utils._python_dispatch import _disable_current_modes

__all__ = ["SettledAllGather", "SettledReduceScatter", "settle_collectives"]


def _untracked_copies(
    output: torch.Tensor, source: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """An empty copy of `output` and a copy of `source`, made outside every dispatch mode."""
    with _disable_current_modes():
        return torch.empty_like(output), source.clone()


def _allocate(
    size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """FSDP's buffer, as FSDP's default collectives allocate it (so the tracker counts it)."""
    return torch.empty(*size, dtype=dtype, device=device)


class SettledAllGather(AllGather):
    """FSDP2's all-gather (`FSDPModule.set_custom_all_gather`), run to completion on copies."""

    def allocate(
        self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        return _allocate(size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> None:
        gathered, own = _untracked_copies(output_tensor, input_tensor)
        with _disable_current_modes():
            dist.all_gather_into_tensor(gathered, own, group=group)
        output_tensor.copy_(gathered)


class SettledReduceScatter(ReduceScatter):
    """FSDP2's reduce-scatter (`FSDPModule.set_custom_reduce_scatter`), run to completion on
    copies."""

    def allocate(
        self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        return _allocate(size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: dist.ReduceOp.RedOpType,
        async_op: bool = False,
    ) -> None:
        shard, full = _untracked_copies(output_tensor, input_tensor)
        with _disable_current_modes():
            dist.reduce_scatter_tensor(shard, full, op=op, group=group)
        output_tensor.copy_(shard)


def settle_collectives(layers: Sequence[FSDPModule], group: dist.ProcessGroup) -> bool:
    """Give `layers` the settled collectives where `group`'s backend finishes works on its own
    threads (not torch's fake one, whose works, and the allocator's peak, stay FSDP's own);
    whether it did."""
    if dist.get_backend(group) == "fake":
        return False
    for layer in layers:
        layer.set_custom_all_gather(SettledAllGather())
        layer.set_custom_reduce_scatter(SettledReduceScatter())
    return True
