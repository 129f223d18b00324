"""A rank's gradients as parts of the whole model's: the global norm (bit-exact, a weight tied
across stages counted once), the verdict that every rank skips a non-finite step together,
fp16's unscaling, clipping, and the per-parameter norms a step publishes instead when no norm
all-reduce runs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from engine.comm.dtensor import is_dtensor
from engine.parallel import ShardedOptimizer, split_over_tp
from engine.runtime.clipping import (
    clip_gradients,
    global_grad_norm,
    global_parameter_order,
    gradient_norms,
)
from engine.runtime.precision import LossScaler
from models import LayerSpec

__all__ = ["StepGradients"]


class StepGradients:
    """This rank's parameters under their global names, in the whole model's order."""

    def __init__(
        self,
        module: nn.Module,
        specs: Sequence[LayerSpec],
        *,
        group: dist.ProcessGroup | None,
        clip_grad_norm: float,
        sharded: ShardedOptimizer | None = None,
        dp_group: dist.ProcessGroup | None = None,
        tp_group: dist.ProcessGroup | None = None,
    ) -> None:
        """`sharded`: under ZeRO-1/2 the gradients live in its fp32 buffers (or shards), and
        the norms, unscaling and clipping act there. `dp_group`: under ZeRO-3 each `.grad` is
        this replica's shard (a DTensor), and norms are summed over the group; `tp_group`: with
        tensor parallelism too, where the tp-split shards' norms are summed over it as well."""
        self._module, self._group, self._clip = module, group, clip_grad_norm
        self._order = global_parameter_order(specs)
        self._sharded, self._dp_group, self._tp_group = sharded, dp_group, tp_group

    def named(self) -> list[tuple[str, nn.Parameter]]:
        """This rank's parameters under their global names (`layers.{i}.…`)."""
        return [(n.split(".", 1)[1], p) for n, p in self._module.named_parameters()]

    def local_norms(self) -> torch.Tensor:
        """Per-parameter norms at their global positions (zeros for the other ranks')."""
        if self._sharded is not None:
            positions = {id(p): self._order[n] for n, p in self.named() if n in self._order}
            return self._sharded.local_norms(positions, len(self._order))
        if self._dp_group is not None:
            return self._shard_norms()
        return gradient_norms(self.named(), self._order)

    def _shard_norms(self) -> torch.Tensor:
        """ZeRO-3: per-parameter norms from the local shards' squares, summed over dp, and
        over tp for the parameters tensor parallelism splits (not those it replicates)."""
        device = next(self._module.parameters()).device
        squares = torch.zeros(2, len(self._order), dtype=torch.float32, device=device)
        for name, param in self.named():
            if name in self._order and param.grad is not None:
                square = torch.linalg.vector_norm(_local(param.grad), 2.0).square()
                squares[int(split_over_tp(param.grad)), self._order[name]] = square
        if self._tp_group is not None:
            dist.all_reduce(squares[1], group=self._tp_group)
        total = squares.sum(dim=0)
        dist.all_reduce(total, group=self._dp_group)
        return total.sqrt()

    def finish(self, loss: float, scaler: LossScaler | None) -> tuple[float, bool]:
        """Unscale (fp16), take the global norm, decide the skip, clip; the same on all ranks
        of the group (a blocking all-reduce when the pipeline has several ranks)."""
        params = list(self._module.parameters())
        if scaler is not None:
            self._scale(params, 1.0 / scaler.scale)
        if self._sharded is not None or self._dp_group is not None:
            total = self.local_norms()
            if self._group is not None:
                dist.all_reduce(total, group=self._group)
            total = torch.linalg.vector_norm(total, 2.0)
        else:
            total = global_grad_norm(
                self.named(), self._order, group=self._group, distributed=self._group is not None
            )
        norm = float(total)
        skipped = not (math.isfinite(norm) and math.isfinite(loss))
        if not skipped and self._clip > 0:
            if self._sharded is not None or self._dp_group is not None:
                self._scale(params, torch.clamp(self._clip / (total + 1e-6), max=1.0))
            else:
                clip_gradients(params, total, self._clip)
        return norm, skipped

    def _scale(self, params: Sequence[nn.Parameter], factor: torch.Tensor | float) -> None:
        if self._sharded is not None:
            self._sharded.scale_gradients(factor)
            return
        for param in params:
            if param.grad is not None:
                _local(param.grad).mul_(factor)


def _local(grad: torch.Tensor) -> torch.Tensor:
    """This rank's part of a gradient: a ZeRO-3 shard's local tensor, or the gradient."""
    return grad.to_local() if is_dtensor(grad) else grad
