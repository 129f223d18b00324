"""Weights tied across stages (GPT-2's embedding and LM head): where each copy lives, the groups
of the ranks that hold one, and the sum of their gradients after a step's backwards.

A tied weight held by two pipeline ranks has a copy on each; both copies start equal (each is
seeded by its tie key) and stay equal because each step sums their gradients over the holders
before the optimizer steps. Two stages on one rank share one parameter instead, so autograd
sums the two uses itself.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from engine.comm.collective import naming_failures
from engine.comm.dtensor import is_dtensor
from models import LayerSpec, LayerStack

__all__ = ["TiedWeights", "new_tie_groups", "share_local_ties", "tied_parameters"]


class TiedWeights:
    """This rank's copies of the weights tied across pipeline ranks, and their groups."""

    def __init__(
        self,
        params: Mapping[str, nn.Parameter],
        groups: Mapping[str, dist.ProcessGroup | None],
        *,
        timeout_s: float,
    ) -> None:
        self._params, self.groups, self._timeout_s = dict(params), dict(groups), timeout_s

    def sum_gradients(self) -> bool:
        """Sum each tied weight's gradient over its holders; whether there was anything to sum.
        Keys go in one order on every rank, so no two holders wait for each other crosswise."""
        for key in sorted(self.groups):
            param = self._params[key]
            grad = getattr(param, "main_grad", None)  # ZeRO's fp32 accumulation view
            if grad is None:
                if param.grad is None:  # a holder whose copy got no gradient takes part
                    param.grad = torch.zeros_like(param)
                grad = param.grad
            if is_dtensor(grad):  # a tp or ZeRO-3 shard: summed in place
                grad = grad.to_local()
            with naming_failures(f"summing tied weight {key!r}", timeout_s=self._timeout_s):
                dist.all_reduce(grad, group=self.groups[key])
        return bool(self.groups)


def tied_parameters(
    module: nn.Module, specs: Sequence[LayerSpec], layers: range
) -> dict[str, nn.Parameter]:
    """This stage's copy of each tied weight, by tie key."""
    found: dict[str, nn.Parameter] = {}
    for i in layers:
        spec = specs[i]
        if spec.tie_key is not None and spec.tie_key not in found:
            found[spec.tie_key] = module.get_parameter(f"layers.{i}.{spec.tied_param}")
    return found


def new_tie_groups(
    specs: Sequence[LayerSpec],
    stage_layers: Sequence[range],
    replica_ranks: Sequence[Sequence[int]],
    *,
    timeout: timedelta,
) -> dict[str, dist.ProcessGroup | None]:
    """For each tie key held by more than one pipeline rank, the group of those ranks.

    `stage_layers[s]` are the layers of stage s; `replica_ranks[d][s]` the global rank holding
    stage s in replica d. Every rank calls this identically (`new_group` is collective over the
    world); only the groups this rank belongs to are kept.
    """
    holders: dict[str, set[int]] = {}
    for stage, layers in enumerate(stage_layers):
        for i in layers:
            if specs[i].tie_key is not None:
                holders.setdefault(str(specs[i].tie_key), set()).add(stage)
    groups: dict[str, dist.ProcessGroup | None] = {}
    for key in sorted(holders):
        for ranks_of_stage in replica_ranks:
            ranks = sorted({ranks_of_stage[s] for s in holders[key]})
            if len(ranks) < 2:
                continue
            group = dist.new_group(ranks, timeout=timeout)
            if dist.get_rank() in ranks:
                groups[key] = group
    return groups


def share_local_ties(
    specs: Sequence[LayerSpec] | Mapping[int, LayerSpec], stacks: Sequence[LayerStack]
) -> None:
    """Layers of one rank's stacks that hold the same tie key share one parameter, so autograd
    sums the uses itself: stages placed on one rank (V placement puts GPT-2's embedding and
    head on rank 0), or one stage whose layers were each given their own (built on meta, or
    split over tp). `specs[i]` describes each stack's layer i."""
    first: dict[str, nn.Parameter] = {}
    for stack in stacks:
        for i in stack.indices:
            spec = specs[i]
            if spec.tie_key is None or spec.tied_param is None:
                continue
            parent_name, _, leaf = f"layers.{i}.{spec.tied_param}".rpartition(".")
            parent = stack.get_submodule(parent_name)
            if spec.tie_key in first:
                setattr(parent, leaf, first[spec.tie_key])
            else:
                first[spec.tie_key] = getattr(parent, leaf)
