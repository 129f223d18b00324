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

from engine.parallel import local_tensor
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
    ) -> None:
        self._module, self._group, self._clip = module, group, clip_grad_norm
        self._order = global_parameter_order(specs)

    def named(self) -> list[tuple[str, nn.Parameter]]:
        """This rank's parameters under their global names (`layers.{i}.…`)."""
        return [(n.split(".", 1)[1], p) for n, p in self._module.named_parameters()]

    def local_norms(self) -> torch.Tensor:
        """Per-parameter norms at their global positions (zeros for the other ranks')."""
        return gradient_norms(self.named(), self._order)

    def finish(self, loss: float, scaler: LossScaler | None) -> tuple[float, bool]:
        """Unscale (fp16), take the global norm, decide the skip, clip; the same on all ranks
        of the group (a blocking all-reduce when the pipeline has several ranks)."""
        params = list(self._module.parameters())
        if scaler is not None:
            for param in params:
                if param.grad is not None:
                    local_tensor(param.grad).mul_(1.0 / scaler.scale)
        total = global_grad_norm(
            self.named(), self._order, group=self._group, distributed=self._group is not None
        )
        norm = float(total)
        skipped = not (math.isfinite(norm) and math.isfinite(loss))
        if not skipped and self._clip > 0:
            clip_gradients(params, total, self._clip)
        return norm, skipped
