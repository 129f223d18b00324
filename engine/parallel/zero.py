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

With tensor parallelism each tp rank flattens its local shards (`FlatGroup`) and `group` is
the dp group of its (stage, tp coordinate): the replicas of one tp slice. Norms count a
tp-split weight as the sum of its shards' squares over the tp group and a replicated one
once; whole masters and optimizer state (checkpoints) are gathered over dp, then over tp.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from engine.comm.dtensor import is_dtensor
from engine.parallel.flat import (
    FlatGroup,
    add_into_main_grad,
    castable_linear_params,
    laid_out_as,
)
from engine.parallel.tensor_parallel import full_tensor, shard_like, split_over_tp

__all__ = ["OptimizerBuilder", "ShardedOptimizer"]

OptimizerBuilder = Callable[[list[dict[str, Any]]], torch.optim.Optimizer]
"""Builds the torch optimizer from its parameter groups (the reference's class and options)."""


class ShardedOptimizer:
    """ZeRO-`level` (1 or 2) for one rank's parameters, over `group`'s `dp` replicas.

    `param_groups` are the reference optimizer's groups (parameters and hyper-parameters);
    `dtype` is the compute dtype (fp32 keeps every weight fp32). The torch optimizer it steps
    is `optimizer`: an ordinary one over this rank's flat master shards, so learning-rate
    schedules and hyper-parameter checks work on it as on any other. `tp_group`: the
    tensor-parallel ranks of this stage when its parameters are tp shards (DTensors).
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
        tp_group: dist.ProcessGroup | None = None,
    ) -> None:
        if level not in (1, 2):
            raise ValueError(f"ShardedOptimizer shards at ZeRO level 1 or 2, not {level}")
        self.level, self.group, self.dp, self.tp_group = level, group, dp, tp_group
        self._split = {id(p) for p in module.parameters() if split_over_tp(p)}
        """The parameters tensor parallelism splits (their norms sum over the tp group)."""
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
            scattered = self.level == 2 and self.dp > 1
            flat.shard_grad = result if scattered else flat.scatter_full(result)
            if self.level == 2:
                flat.end_accumulation()  # only the shard stays (at dp 1 it is the whole)
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
        parameter whole in one shard keeps its exact norm). A tp-split parameter's squares
        are summed over the tp group too; a replicated one counts once."""
        device = self.flats[0].weights.device if self.flats else torch.device("cpu")
        norms = torch.zeros(3, length, dtype=torch.float32, device=device)
        whole, partial, split = norms[0], norms[1], norms[2]
        for flat in self.flats:
            if flat.grads is not None:
                for slot in flat.slots:
                    if id(slot.param) in positions:
                        view = flat.grads[slot.start : slot.stop]
                        self._put(norms, slot.param, positions, view, whole=True)
                continue
            assert flat.shard_grad is not None
            for slot, inside, in_shard in flat.owned():
                if id(slot.param) in positions:
                    all_of_it = inside.stop - inside.start == slot.numel
                    view = flat.shard_grad[in_shard]
                    self._put(norms, slot.param, positions, view, whole=all_of_it)
        if self.level == 2 and self.dp > 1:
            dist.all_reduce(norms if self.tp_group is not None else norms[:2], group=self.group)
        if self.tp_group is not None:
            dist.all_reduce(split, group=self.tp_group)
            return whole + partial.sqrt() + split.sqrt()
        if self.level == 1 or self.dp == 1:
            return whole
        return whole + partial.sqrt()

    def _put(
        self,
        norms: torch.Tensor,
        param: nn.Parameter,
        positions: Mapping[int, int],
        grad: torch.Tensor,
        *,
        whole: bool,
    ) -> None:
        """Record one gradient's part: its norm when it is the whole parameter's, else its
        square to be summed (over dp, and over tp for a tp-split parameter)."""
        norm = torch.linalg.vector_norm(grad, 2.0)
        position = positions[id(param)]
        if id(param) in self._split:
            norms[2, position] += norm.square()
        elif whole:
            norms[0, position] = norm
        else:
            norms[1, position] += norm.square()

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
        """Every parameter's fp32 master, whole (collective over the replicas, then over the
        tp ranks for tp shards)."""
        out: dict[int, torch.Tensor] = {}
        for flat in self.flats:
            out.update(_whole_over_tp(flat, flat.unflatten(self._gather(flat, flat.master))))
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
                    parts = _whole_over_tp(flat, flat.unflatten(self._gather(flat, value)))
                    for pid, part in parts.items():
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
        """Set weights and masters from whole fp32 tensors (by parameter id; a tp shard takes
        its slice) and, when given, the optimizer state per parameter and the
        hyper-parameters per reference group."""
        with torch.no_grad():
            for flat in self.flats:
                full = flat.flatten(lambda p: shard_like(p, masters[id(p)]))
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
    return shard_like(param, state[id(param)][key])


def _whole_over_tp(flat: FlatGroup, parts: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
    """Each parameter's part (its local shape) whole: a tp shard gathered over its tp group
    (collective; every tp rank walks the same parameters in the same order)."""
    for slot in flat.slots:
        param = slot.param
        if is_dtensor(param):
            parts[id(param)] = full_tensor(laid_out_as(param, parts[id(param)].contiguous()))
    return parts


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
