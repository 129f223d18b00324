"""Semi-synchronous data parallelism: the replicas of a stage train alone and meet every H steps.

Each replica steps its own (inner) optimizer on its own share of the batch. Every H steps the
replicas of each stage meet over the mesh's dp group, which nothing else touches in between:
local SGD averages the parameters; DiLoCo averages each replica's outer gradient (the weights
of the last meeting minus its own) and an outer SGD with Nesterov momentum applies it to the
weights of the last meeting, which every replica then holds. Only this stage's parameters
travel, in a few flat buckets, so every stage meets the same stage of the other replicas.

torchft's `LocalSGD` and `DiLoCo` run the same algorithms, but only through its `Manager`
(a Lighthouse quorum and a process group of its own per replica group) and count the inner
optimizer's steps through hooks, so a step the non-finite guard skips on one replica would
shift that replica's meetings against the others'; here meetings follow the engine's steps.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from engine.config import ReplicaSync
from engine.parallel.tensor_parallel import local_tensor

__all__ = ["ReplicaMeetings"]


class ReplicaMeetings:
    """Counts a stage's steps and, every `sync_every`, brings its replicas together."""

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        group: dist.ProcessGroup | None,
        sync: ReplicaSync,
        *,
        dp: int,
        bucket_bytes: int = 25 * 2**20,
    ) -> None:
        assert sync.periodic, "every-step sync sums gradients (comm.grad_sync), not weights"
        self.sync, self._group, self._dp = sync, group, dp
        self._params = list(params)
        self._buckets = _buckets([local_tensor(p) for p in self._params], bucket_bytes)
        self.steps_since = 0
        """Steps this replica trained since the last meeting."""
        self.bytes_per_meeting = sum(_nbytes(local_tensor(p)) for p in self._params)
        """What this rank all-reduces at each meeting (parameters or outer gradients)."""
        self.anchors: list[torch.Tensor] = []
        """DiLoCo: the weights of the last meeting, which the outer optimizer steps."""
        self.outer: torch.optim.SGD | None = None
        if sync.dp_sync == "diloco":
            self.anchors = [local_tensor(p).detach().clone() for p in self._params]
            momentum = sync.outer_momentum
            self.outer = torch.optim.SGD(
                self.anchors, lr=sync.outer_lr, momentum=momentum, nesterov=momentum > 0
            )

    def after_step(self) -> tuple[float, float] | None:
        """Count a step (taken or skipped: replicas meet after the same steps); at the H-th,
        meet. Returns the meeting's perf_counter window, or None between meetings."""
        self.steps_since += 1
        if self.steps_since < self.sync.sync_every:
            return None
        start = time.perf_counter()
        self.meet()
        return start, time.perf_counter()

    def meet(self) -> None:
        """Bring every replica of the stage to the same weights (collective over dp)."""
        with torch.no_grad():
            if self.outer is None:
                self._average([local_tensor(p) for p in self._params])
            else:
                self._outer_step()
        self.steps_since = 0

    def _outer_step(self) -> None:
        assert self.outer is not None
        moved = [a - local_tensor(p) for a, p in zip(self.anchors, self._params, strict=True)]
        self._average(moved)
        for anchor, grad in zip(self.anchors, moved, strict=True):
            anchor.grad = grad
        self.outer.step()
        self.outer.zero_grad(set_to_none=True)
        for anchor, param in zip(self.anchors, self._params, strict=True):
            local_tensor(param).copy_(anchor)

    def _average(self, tensors: list[torch.Tensor]) -> None:
        """Replace each tensor by its mean over the replicas, in place, bucket by bucket."""
        for bucket in self._buckets:
            chosen = [tensors[i] for i in bucket]
            flat = _flatten_dense_tensors(chosen)
            dist.all_reduce(flat, group=self._group)
            flat /= self._dp
            for tensor, mean in zip(chosen, _unflatten_dense_tensors(flat, chosen), strict=True):
                tensor.copy_(mean)

    def reset_anchors(self) -> None:
        """DiLoCo: the current weights become the last meeting's (after loading weights)."""
        with torch.no_grad():
            for anchor, param in zip(self.anchors, self._params, strict=True):
                anchor.copy_(local_tensor(param))
        self.steps_since = 0

    def momenta(self) -> dict[int, torch.Tensor]:
        """DiLoCo's outer momentum buffer of each parameter (by `id`), where one exists."""
        if self.outer is None:
            return {}
        state = self.outer.state
        return {
            id(p): state[a]["momentum_buffer"]
            for p, a in zip(self._params, self.anchors, strict=True)
            if state.get(a, {}).get("momentum_buffer") is not None
        }

    def load_momenta(self, momenta: dict[int, torch.Tensor]) -> None:
        """Restore outer momentum buffers (by parameter `id`, local shards)."""
        assert self.outer is not None
        for param, anchor in zip(self._params, self.anchors, strict=True):
            if id(param) in momenta:
                buffer = momenta[id(param)].to(anchor.device, anchor.dtype).clone()
                self.outer.state[anchor] = {"momentum_buffer": buffer}


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _buckets(tensors: list[torch.Tensor], bucket_bytes: int) -> list[list[int]]:
    """Indexes of `tensors` in runs of about `bucket_bytes`, one dtype per run."""
    buckets: list[list[int]] = []
    size, dtype = bucket_bytes, None
    for i, tensor in enumerate(tensors):
        if size >= bucket_bytes or tensor.dtype != dtype:
            buckets.append([])
            size, dtype = 0, tensor.dtype
        buckets[-1].append(i)
        size += _nbytes(tensor)
    return buckets
