"""The model states of one rank's stages in a measured step, kept and reduced as the engine
keeps and reduces them: AdamW over the parameters and, with replicas, the bucketed all-reduce
(ZeRO-0); ZeRO-1/2's flat buffers and sharded masters (`ShardedOptimizer`); ZeRO-3's FSDP2
layers; tensor-parallel DTensors under any of them. The collectives run on the `StageGrid`
(torch's fake process group in one process), so each allocates what it allocates for real.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, cast
from unittest import mock

import torch
from torch import nn

from engine.comm.grad_sync import BucketedAllReduce
from engine.config import OptimizerSpec, check_zero_optimizer
from engine.memory.fake_world import StageGrid
from engine.memory.tracker import MemoryTracker
from engine.parallel import (
    FullyShardedLayers,
    ShardedOptimizer,
    align_gradients,
    local_tensor,
)
from engine.runtime.optim import build_from_spec, build_sharded
from engine.runtime.precision import compute_dtype
from engine.runtime.sharded_stages import fully_shard_stages
from engine.runtime.stage import PipelineStage

if TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule

__all__ = ["RankStates", "fsdp_resizes", "gathered_bytes"]


@contextlib.contextmanager
def fsdp_resizes(tracker: MemoryTracker) -> Iterator[None]:
    """Tell `tracker` of FSDP2's storage resizes: it allocates each gathered parameter once
    and then frees and reallocates its storage in place (`storage.resize_`), which no op
    dispatch shows."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param, _fsdp_param_group

    def alloc(tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        size = tensor.numel() * tensor.itemsize
        if storage.size() != size:
            storage.resize_(size)
            tracker.resized(storage, size)

    def free(tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        if storage.size() != 0:
            storage.resize_(0)
            tracker.resized(storage, 0)

    with (
        mock.patch.object(_fsdp_param, "alloc_storage", alloc),
        mock.patch.object(_fsdp_param, "free_storage", free),
        mock.patch.object(_fsdp_param_group, "alloc_storage", alloc),
    ):
        yield


class RankStates:
    """One rank's parameters, gradients and optimizer through a step: `begin` before the
    schedule, `gradients_final` after its last backward (sends still held), `step` after the
    sends completed. The optimizer has stepped once already, so its states exist as in any
    step but the first."""

    def __init__(
        self,
        stages: Sequence[PipelineStage],
        *,
        zero: int,
        reshard: Sequence[str],
        precision: str,
        spec: OptimizerSpec,
        grid: StageGrid,
    ) -> None:
        self.module = nn.ModuleList(stage.module for stage in stages)
        self.fsdp: FullyShardedLayers | None = None
        self._reduce: BucketedAllReduce | None = None
        self._masters: list[nn.Parameter] = []
        """The parameters the reduction sums, taken before a step scope swaps weight copies
        in: their gradients are noted as the reduction starts, which makes them views."""
        self.sharded: ShardedOptimizer | None = None
        dtype = compute_dtype(precision)
        if zero == 3:
            check_zero_optimizer(zero, spec.impl)
            self.fsdp = fully_shard_stages(
                stages, grid.dp_mesh, precision, pp_rank=0, reshard=reshard
            )
            from engine.memory.settled import settle_collectives  # imports FSDP2

            assert grid.dp_group is not None  # zero=3's grid has a dp mesh
            settle_collectives(self.fsdp.layers, grid.dp_group)
        if zero in (1, 2):
            group, dp, dp_rank = grid.dp_group, grid.dp, grid.dp_rank
            self.sharded = build_sharded(
                spec, self.module, level=zero, dtype=dtype, group=group, dp=dp, dp_rank=dp_rank
            )
            self.optimizer = self.sharded.optimizer
        else:
            self.optimizer = build_from_spec(spec, self.module)
            if zero == 0 and grid.dp > 1:
                self._masters = list(self.module.parameters())
                self._reduce = BucketedAllReduce(self._masters, grid.dp_group)
        self._tp = grid.tp > 1
        self._prime()
        self.gradients: dict[int, int] = {}
        """Bytes of each storage of the step's gradients once final, before their reduction
        (sizes only: holding the tensors would keep ZeRO-2's full buffer alive)."""

    def _prime(self) -> None:
        """Step the optimizer once on zero gradients, so that its states exist."""
        params = [f.master for f in self.sharded.flats] if self.sharded else self.params()
        for param in params:
            param.grad = torch.zeros_like(param)
        self.optimizer.step()
        for param in params:
            param.grad = None

    def params(self) -> list[nn.Parameter]:
        return list(self.module.parameters())

    def begin(self) -> None:
        """The engine's `train_step` before the schedule: fresh gradient buffers, or FSDP's
        step protocol (the replay has set every `.grad` to None)."""
        if self.sharded is not None:
            self.sharded.begin_step()
        if self.fsdp is not None:
            self.fsdp.begin_step()

    def gradients_final(self) -> None:
        """After the rank's last backward: note ZeRO's gradients (the plain ones are noted
        after the step scope, which holds the weight copies in their place), start the
        reduction."""
        if self.sharded is not None or self.fsdp is not None:
            self._note_gradients()
        if self._reduce is not None:  # before its buckets replace them
            self._note_gradients(
                [local_tensor(p.grad) for p in self._masters if p.grad is not None]
            )
        start: Callable[[], None] = self._reduce.start if self._reduce else lambda: None
        if self._tp:
            start = functools.partial(align_gradients, self.params(), then=start)
        if self.fsdp is not None:
            start = self.fsdp.reduce_gradients
        if self.sharded is not None:
            start = self.sharded.start_reduction
        start()

    def _note_gradients(self, gradients: Sequence[torch.Tensor] | None = None) -> None:
        made = self._gradients() if gradients is None else gradients
        self.gradients = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in made}

    def step(self) -> None:
        """After the sends: wait for the reduction, then step (ZeRO-1/2 all-gather after)."""
        if self.sharded is None and self.fsdp is None and self._reduce is None:
            self._note_gradients()
        if self.sharded is not None:
            self.sharded.finish_reduction()
            self.sharded.step()
            return
        if self._reduce is not None:
            self._reduce.finish()
        self.optimizer.step()

    def _gradients(self) -> list[torch.Tensor]:
        if self.sharded is not None:
            return [f.grads for f in self.sharded.flats if f.grads is not None]
        if self.fsdp is not None:
            modules = cast(list[nn.Module], self.fsdp.resharded)  # FSDPModule subclasses them
            resharded = [p for layer in modules for p in layer.parameters()]
            sharded = [local_tensor(p.grad) for p in resharded if p.grad is not None]
            return _unsharded_grads(self.fsdp.kept) + sharded
        return [local_tensor(p.grad) for p in self.params() if p.grad is not None]

    def gathered(self) -> int:
        """Bytes of ZeRO-3's gathered layers now (`gathered_bytes`)."""
        return gathered_bytes(self.fsdp)

    def weights(self) -> list[torch.Tensor]:
        """The tensors kept across steps as weights (this rank's shards)."""
        return [local_tensor(p) for p in self.params()]

    def optimizer_states(self) -> list[torch.Tensor]:
        """The optimizer's states and, under ZeRO-1/2, the fp32 master shards."""
        states = [
            local_tensor(t)
            for state in self.optimizer.state.values()
            for t in state.values()
            if isinstance(t, torch.Tensor)
        ]
        masters = [f.master for f in self.sharded.flats] if self.sharded else []
        return states + masters


def gathered_bytes(fsdp: FullyShardedLayers | None) -> int:
    """Bytes of ZeRO-3's gathered layers now (FSDP2's all-gather outputs in use); 0 without."""
    if fsdp is None:
        return 0
    from torch.distributed.fsdp import fully_shard

    return sum(
        t.untyped_storage().nbytes()
        for layer in fsdp.layers
        for group in fully_shard.state(layer)._fsdp_param_groups  # type: ignore[attr-defined]
        for param in group.fsdp_params
        for t in param.all_gather_outputs
    )


def _unsharded_grads(layers: Sequence[FSDPModule]) -> list[torch.Tensor]:
    """FSDP2's unsharded gradients of `layers` accumulated over the step (fp32, or the compute
    dtype's where no reduction dtype differs)."""
    from torch.distributed.fsdp import fully_shard

    found = []
    for layer in layers:
        state = fully_shard.state(layer)  # type: ignore[attr-defined]
        for group in state._fsdp_param_groups:
            for param in group.fsdp_params:
                grad = param.unsharded_accumulated_grad
                if grad is None and param._unsharded_param.grad is not None:
                    grad = param._unsharded_param.grad
                if grad is not None:
                    found.append(local_tensor(grad))
    return found
