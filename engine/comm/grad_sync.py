"""Gradient reduction across the data-parallel replicas of a stage.

Gradients are summed (each micro-batch loss is already divided by the global number of
micro-batches), in buckets of flattened gradients so a stage sends a few large messages, and
started asynchronously as soon as the stage's last backward of the step is done.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors

from engine.comm.dtensor import is_dtensor

__all__ = ["BucketedAllReduce"]


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor-parallel (DTensor) parameter's or gradient's local shard: the replicas of a
    stage hold the same shards, so their gradients are summed shard by shard."""
    return tensor.to_local() if is_dtensor(tensor) else tensor


def _like(param: nn.Parameter, grad: torch.Tensor) -> torch.Tensor:
    """A summed local gradient as the parameter's gradient (a DTensor of the same layout)."""
    if not is_dtensor(param):
        return grad
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(grad, param.device_mesh, param.placements, run_check=False)


def _views(flat: torch.Tensor, bucket: Sequence[nn.Parameter]) -> list[torch.Tensor]:
    """Each parameter's part of a flat bucket (its counts last), shaped as its local shard."""
    shapes = [_local(p).shape for p in bucket]
    pieces = torch.split(flat, [*(s.numel() for s in shapes), len(bucket)])
    return [piece.view(shape) for piece, shape in zip(pieces[:-1], shapes, strict=True)]


class BucketedAllReduce:
    """Sum a set of parameters' gradients over a group, bucket by bucket, asynchronously;
    or, given `reduce` (a fault-tolerant replica's torchft average over its quorum), reduce
    each bucket through it."""

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        group: dist.ProcessGroup | None,
        *,
        bucket_bytes: int = 25 * 2**20,
        reduce: Callable[[torch.Tensor], Any] | None = None,
    ) -> None:
        self._group = group
        self._reduce = reduce or self._all_reduce
        self._buckets: list[list[nn.Parameter]] = [[]]
        size = 0
        for param in params:
            if size >= bucket_bytes:
                self._buckets.append([])
                size = 0
            self._buckets[-1].append(param)
            size += param.numel() * param.element_size()
        self._inflight: list[tuple[Any, torch.Tensor, list[nn.Parameter], bool]] = []
        self.window: tuple[float, float] | None = None
        """perf_counter times of the last `start` and the end of its `finish`."""

    def start(self) -> None:
        """Post every bucket's all-reduce. A missing gradient counts as zeros, and each bucket
        also sums how many ranks held each gradient, so one no rank produced stays None (as
        in one process: AdamW leaves such a parameter alone, zeros would decay it). Each
        gradient becomes a view of its bucket's flat copy as soon as the bucket is made, so
        the flat copies replace the gradients (the sums land in them in place) instead of
        doubling them until the reduction ends."""
        self.window = (time.perf_counter(), time.perf_counter())
        for bucket in self._buckets:
            if not bucket:
                continue
            grads = [
                _local(p.grad) if p.grad is not None else _local(p).new_zeros(_local(p).shape)
                for p in bucket
            ]
            held = [float(p.grad is not None) for p in bucket]
            counts = torch.tensor(held, dtype=grads[0].dtype, device=grads[0].device)
            flat = _flatten_dense_tensors([*grads, counts])
            del grads
            for param, view in zip(bucket, _views(flat, bucket), strict=True):
                param.grad = _like(param, view)
            work = self._reduce(flat)
            self._inflight.append((work, flat, bucket, 0.0 in held))

    def _all_reduce(self, flat: torch.Tensor) -> dist.Work:
        work = dist.all_reduce(flat, group=self._group, async_op=True)
        assert work is not None
        return work

    def finish(self) -> None:
        """Wait for the reductions (each gradient, a view of its bucket, then holds the sum);
        a gradient no rank held goes back to None."""
        for work, flat, bucket, some_missing in self._inflight:
            work.wait()
            if some_missing:
                counts = flat[flat.numel() - len(bucket) :].tolist()  # a sync
                for param, count in zip(bucket, counts, strict=True):
                    if count == 0:
                        param.grad = None
        if self._inflight and self.window is not None:
            self.window = (self.window[0], time.perf_counter())
        self._inflight = []
