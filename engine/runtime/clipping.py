"""Global gradient norm and clipping over the whole model, whatever the layout.

Every parameter's norm is computed where its gradient lives, scattered into a vector indexed
by the parameter's global position, and summed over the pipeline group (adding zeros is
exact), so every rank then reduces the same vector in the same order as a single process
would: the norm, and the clipped gradients, equal the reference's bit for bit. A weight tied
across stages counts once, at its first occurrence.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from engine.parallel import local_tensor, split_gradient_norms
from models import LayerSpec

__all__ = ["clip_gradients", "global_grad_norm", "global_parameter_order", "gradient_norms"]


def global_parameter_order(specs: Sequence[LayerSpec]) -> dict[str, int]:
    """Position of every parameter in the whole model's `named_parameters` order.

    Built from meta modules, so it costs no memory; a tied weight's later copies are left out,
    as `named_parameters` leaves out a shared parameter.
    """
    order: dict[str, int] = {}
    seen_ties: set[str] = set()
    for i, spec in enumerate(specs):
        for name, _ in spec.build("meta").named_parameters():
            if name == spec.tied_param and spec.tie_key is not None:
                if spec.tie_key in seen_ties:
                    continue
                seen_ties.add(spec.tie_key)
            order[f"layers.{i}.{name}"] = len(order)
    return order


def gradient_norms(
    named_params: Sequence[tuple[str, nn.Parameter]], order: dict[str, int]
) -> torch.Tensor:
    """This rank's per-parameter gradient norms at their global positions (zeros elsewhere):
    summed over the pipeline, they give every rank the whole model's vector."""
    device = named_params[0][1].device if named_params else torch.device("cpu")
    grads = [
        (order[name], param.grad)
        for name, param in named_params
        if name in order and param.grad is not None
    ]
    return split_gradient_norms(grads, len(order), device)


def global_grad_norm(
    named_params: Sequence[tuple[str, nn.Parameter]],
    order: dict[str, int],
    *,
    group: dist.ProcessGroup | None = None,
    distributed: bool = False,
) -> torch.Tensor:
    """The global L2 norm of the gradients (a 0-d tensor, the same on every rank of `group`).

    `named_params` are this rank's parameters under their global names; names missing from
    `order` (a tied copy counted elsewhere) are skipped.
    """
    norms = gradient_norms(named_params, order)
    if distributed:
        dist.all_reduce(norms, group=group)
    return torch.linalg.vector_norm(norms, 2.0)


def clip_gradients(params: Sequence[nn.Parameter], total: torch.Tensor, max_norm: float) -> None:
    """Scale gradients by min(1, max_norm / (norm + 1e-6)), as `clip_grad_norm_` does."""
    if max_norm <= 0 or not math.isfinite(float(total)):
        return
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for param in params:
        if param.grad is not None:
            grad = local_tensor(param.grad)
            grad.mul_(coef.to(grad.dtype))
