"""ZeRO-1 and ZeRO-2 over the data-parallel replicas of a stage, as Megatron's distributed
optimizer means them.

Under bf16/fp16 every weight autocast would cast (the Linears') is kept in the compute dtype
only; its gradient accumulates into an fp32 buffer (`main_grad`), exactly as `WeightCopies`
adds it into the fp32 master today, so dp = 1 keeps the reference's bits. The fp32 master
weights and the optimizer's moments exist only for this rank's 1/dp shard of each flat buffer
(one per optimizer group and dtype: decay and no-decay stay apart). Weights autocast never
casts (embeddings, norms) stay fp32 and replicated; under fp32 every weight is its own master.

ZeRO-1 all-reduces the fp32 gradient buffers and each rank reads its shard; ZeRO-2
reduce-scatters them, and each rank keeps only its shard's gradient. Both start when the
stage's last backward of the step is done and are waited for before the norm. After the
optimizer steps each rank's shard (the same torch optimizer class as the reference, on flat
shard tensors), the updated masters are cast to the weights' dtype and all-gathered into them.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from engine.parallel.flat import FlatGroup, add_into_main_grad, castable_linear_params

__all__ = ["OptimizerBuilder", "ShardedOptimizer"]

OptimizerBuilder = Callable[[list[dict[str, Any]]], torch.optim.Optimizer]
"""Builds the torch optimizer from its parameter groups (the reference's class and options)."""


class ShardedOptimizer:
    """ZeRO-`level` (1 or 2) for one rank's parameters, over `group`'s `dp` replicas.

    `param_groups` are the reference optimizer's groups (parameters and hyper-parameters);
    `dtype` is the compute dtype (fp32 keeps every weight fp32). The torch optimizer it steps
    is `optimizer`: an ordinary one over this rank's flat master shards, so learning-rate
    schedules and hyper-parameter checks work on it as on any other.
    """

    def __init__(
        self,
        module: nn.Module,
        param_groups: Sequence[Mapping[str, Any]],
        build: OptimizerBuilder,
        *,
        level: int,
        dtype: torch.dtype,
        group: dist.ProcessGroup | None,
        dp: int,
        dp_rank: int,
    ) -> None:
        if level not in (1, 2):
            raise ValueError(f"ShardedOptimizer shards at ZeRO level 1 or 2, not {level}")
        self.level, self.group, self.dp = level, group, dp
        self.num_groups = len(param_groups)
        narrow = set()
        if dtype != torch.float32:
            narrow = {id(p) for p in castable_linear_params(module)}
        self.flats: list[FlatGroup] = []
        self.group_of: list[int] = []
        """Index of the reference's parameter group each flat buffer belongs to."""
        inner: list[dict[str, Any]] = []
        for index, spec in enumerate(param_groups):
            params = [p for p in spec["params"] if p.requires_grad]
            for kind in (dtype, torch.float32) if narrow else (torch.float32,):
                chosen = [p for p in params if (id(p) in narrow) == (kind != torch.float32)]
                if not chosen:
                    continue
                flat = FlatGroup(chosen, kind, dp=dp, dp_rank=dp_rank)
                self.flats.append(flat)
                self.group_of.append(index)
                inner.append({**{k: v for k, v in spec.items() if k != "params"}})
                inner[-1]["params"] = [flat.master]
        for flat in self.flats:
            if flat.dtype != torch.float32:
                for slot in flat.slots:
                    slot.param.register_post_accumulate_grad_hook(add_into_main_grad)
        self.optimizer = build(inner)
        self._inflight: list[tuple[dist.Work | None, FlatGroup, torch.Tensor]] = []
        self.window: tuple[float, float] | None = None
        """perf_counter times of the last reduction's start and the end of its wait."""

    @property
    def params(self) -> list[nn.Parameter]:
        return [slot.param for flat in self.flats for slot in flat.slots]

    def reference_groups(self) -> list[dict[str, Any]]:
        """The hyper-parameters of the reference optimizer's groups (without parameters), as
        the inner optimizer holds them now (a learning-rate schedule changes them there)."""
        out: list[dict[str, Any]] = [{} for _ in range(self.num_groups)]
        for inner, index in zip(self.optimizer.param_groups, self.group_of, strict=True):
            if not out[index]:
                out[index] = {k: v for k, v in inner.items() if k != "params"}
        fallback = {k: v for k, v in self.optimizer.param_groups[0].items() if k != "params"}
        return [group or fallback for group in out]

    def begin_step(self) -> None:
        """Zeroed fp32 gradient buffers for the step's accumulation (ZeRO-2's last shard goes)."""
        for flat in self.flats:
            flat.shard_grad = None
            flat.master.grad = None
            flat.begin_accumulation()

    def start_reduction(self) -> None:
        """Post every buffer's all-reduce (ZeRO-1) or reduce-scatter (ZeRO-2), asynchronously."""
        self.window = (time.perf_counter(), time.perf_counter())
        for flat in self.flats:
            full = flat.grads
            assert full is not None, "begin_step makes the buffers a reduction reduces"
            if self.dp == 1:
                self._inflight.append((None, flat, full))
            elif self.level == 1:
                work = dist.all_reduce(full, group=self.group, async_op=True)
                self._inflight.append((work, flat, full))
            else:
                out = torch.empty(flat.shard_numel, dtype=full.dtype, device=full.device)
                work = dist.reduce_scatter_single(out, full, group=self.group, async_op=True)
                self._inflight.append((work, flat, out))

    def finish_reduction(self) -> None:
        """Wait for the reductions; each master shard's `.grad` is its reduced gradient."""
        for work, flat, result in self._inflight:
            if work is not None:
                work.wait()
            if self.level == 1 or self.dp == 1:
                flat.shard_grad = flat.scatter_full(result)
            else:
                flat.shard_grad = result
            if self.level == 2:
                if self.dp == 1:
                    flat.shard_grad = flat.shard_grad.clone()
                flat.end_accumulation()
            flat.master.grad = flat.shard_grad
        if self._inflight and self.window is not None:
            self.window = (self.window[0], time.perf_counter())
        self._inflight = []

    def scale_gradients(self, factor: torch.Tensor | float) -> None:
        """Multiply the gradients this rank reads (the full ones under ZeRO-1, for the norm)."""
        for flat in self.flats:
            grads = flat.grads if flat.grads is not None else flat.shard_grad
            if grads is not None:
                grads.mul_(factor)

    def local_norms(self, positions: Mapping[int, int], length: int) -> torch.Tensor:
        """Each parameter's gradient norm at its global position (`positions`: parameter id →
        position; others are skipped), as the reference computes it: from the whole reduced
        gradient under ZeRO-1; under ZeRO-2 from the shards, summed over the replicas (a
        parameter whole in one shard keeps its exact norm)."""
        device = self.flats[0].weights.device if self.flats else torch.device("cpu")
        whole = torch.zeros(length, dtype=torch.float32, device=device)
        partial = torch.zeros(length, dtype=torch.float32, device=device)
        for flat in self.flats:
            if flat.grads is not None:
                for slot in flat.slots:
                    if id(slot.param) in positions:
                        view = flat.grads[slot.start : slot.stop]
                        whole[positions[id(slot.param)]] = torch.linalg.vector_norm(view, 2.0)
                continue
            assert flat.shard_grad is not None
            for slot, inside, in_shard in flat.owned():
                if id(slot.param) not in positions:
                    continue
                norm = torch.linalg.vector_norm(flat.shard_grad[in_shard], 2.0)
                if inside.stop - inside.start == slot.numel:
                    whole[positions[id(slot.param)]] = norm
                else:
                    partial[positions[id(slot.param)]] += norm.square()
        if self.level == 1 or self.dp == 1:
            return whole
        both = torch.cat([whole, partial])
        dist.all_reduce(both, group=self.group)
        return both[:length] + both[length:].sqrt()

    def step(self) -> None:
        """Step this rank's shard, then cast and all-gather the updated weights."""
        self.optimizer.step()
        with torch.no_grad():
            for flat in self.flats:
                if flat.dtype != torch.float32:
                    flat.weights[flat.shard].copy_(flat.master)
                if self.dp > 1:
                    mine = flat.weights[flat.shard].clone()
                    dist.all_gather_single(flat.weights, mine, group=self.group)

    def _gather(self, flat: FlatGroup, shard: torch.Tensor) -> torch.Tensor:
        if self.dp == 1:
            return shard.detach().clone()
        full = torch.empty(flat.padded, dtype=shard.dtype, device=shard.device)
        dist.all_gather_single(full, shard.detach().contiguous(), group=self.group)
        return full

    def full_masters(self) -> dict[int, torch.Tensor]:
        """Every parameter's fp32 master, whole (collective over the replicas)."""
        out: dict[int, torch.Tensor] = {}
        for flat in self.flats:
            out.update(flat.unflatten(self._gather(flat, flat.master)))
        return out

    def full_state(self) -> dict[int, dict[str, Any]]:
        """Every parameter's optimizer state, whole, keyed as the reference keys it
        (collective): sharded tensors gathered and cut per parameter, scalars (the step)
        given to each."""
        out: dict[int, dict[str, Any]] = {}
        for flat in self.flats:
            state = self.optimizer.state.get(flat.master, {})
            per_param: dict[int, dict[str, Any]] = {id(s.param): {} for s in flat.slots}
            for key, value in sorted(state.items()):
                if isinstance(value, torch.Tensor) and value.dim() == 1:
                    for pid, part in flat.unflatten(self._gather(flat, value)).items():
                        per_param[pid][key] = part
                else:
                    for entry in per_param.values():
                        entry[key] = value.clone() if isinstance(value, torch.Tensor) else value
            out.update(per_param)
        return out

    def load(
        self,
        masters: Mapping[int, torch.Tensor],
        state: Mapping[int, Mapping[str, Any]] | None,
        hyper: Sequence[Mapping[str, Any]] | None = None,
    ) -> None:
        """Set weights and masters from whole fp32 tensors (by parameter id) and, when given,
        the optimizer state per parameter and the hyper-parameters per reference group."""
        with torch.no_grad():
            for flat in self.flats:
                full = flat.flatten(lambda p: masters[id(p)])
                flat.weights.copy_(full)
                if flat.dtype != torch.float32:
                    flat.master.copy_(full[flat.shard])
        if state is not None:
            for flat in self.flats:
                self.optimizer.state[flat.master] = _shard_state(flat, state)
        if hyper is not None:
            for inner, index in zip(self.optimizer.param_groups, self.group_of, strict=True):
                inner.update({k: v for k, v in hyper[index].items() if k != "params"})


def _state_of(state: Mapping[int, Mapping[str, Any]], key: str, param: nn.Parameter) -> Any:
    return state[id(param)][key]


def _shard_state(flat: FlatGroup, state: Mapping[int, Mapping[str, Any]]) -> dict[str, Any]:
    """One flat buffer's shard of per-parameter optimizer state."""
    first = state.get(id(flat.slots[0].param), {})
    out: dict[str, Any] = {}
    for key, value in first.items():
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            full = flat.flatten(functools.partial(_state_of, state, key))
            out[key] = full[flat.shard].clone()
        else:
            out[key] = value.clone() if isinstance(value, torch.Tensor) else value
    return out
