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

import functools
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllocMixin
from torch.utils._python_dispatch import _disable_current_modes

__all__ = ["SettledAllGather", "SettledReduceScatter", "settle_collectives"]


def _settled(
    collective: Callable[[torch.Tensor, torch.Tensor], object],
    output: torch.Tensor,
    source: torch.Tensor,
) -> None:
    """`collective(out, src)` run to completion outside every dispatch mode on copies of
    `output` and `source` (which the backend may free on its own thread), then its result
    copied into `output`."""
    with _disable_current_modes():
        out, src = torch.empty_like(output), source.clone()
        collective(out, src)
    output.copy_(out)


class SettledAllGather(DefaultAllocMixin, AllGather):
    """FSDP2's all-gather (`FSDPModule.set_custom_all_gather`), run to completion on copies;
    its buffer allocated as FSDP's default one is (so the tracker counts it)."""

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> None:
        gather = functools.partial(dist.all_gather_into_tensor, group=group)
        _settled(gather, output_tensor, input_tensor)


class SettledReduceScatter(DefaultAllocMixin, ReduceScatter):
    """FSDP2's reduce-scatter (`FSDPModule.set_custom_reduce_scatter`), run to completion on
    copies; its buffer allocated as FSDP's default one is."""

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: dist.ReduceOp.RedOpType,
        async_op: bool = False,
    ) -> None:
        scatter = functools.partial(dist.reduce_scatter_tensor, op=op, group=group)
        _settled(scatter, output_tensor, input_tensor)


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
