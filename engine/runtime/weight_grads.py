"""The W half of a split backward: each deferred Linear's weight gradient, accumulated where
autograd's fused backward would have put it.

`PipelineStage.backward_input` (the I half) records, per micro-batch, every Linear's input and
its output's gradient; `run_weight_grads` takes them later, when the schedule runs the W.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from engine.parallel import as_gradient_of, local_gradient, local_tensor

__all__ = ["PendingWeightGrad", "accumulate", "linear_weight_grads", "run_weight_grads"]


@dataclass
class PendingWeightGrad:
    nodes: list[tuple[nn.Module, torch.Tensor, torch.Tensor | None, torch.Tensor]]
    """(Linear, input, output, gradient at the output) waiting for their W; the output only
    when W goes through autograd (it keeps the graph alive)."""


def run_weight_grads(
    pending: PendingWeightGrad, master: Callable[[nn.Parameter], nn.Parameter] | None
) -> None:
    """Each Linear's parameter gradients from its output's gradient, into `master(p)` (the
    fp32 parameter behind a low-precision copy) or `p` itself.

    Modules go last-to-first, the order a fused backward reaches them; in fp32 each is the
    very GEMM autograd would run (same operands, same bits), otherwise one autograd call
    that stops at the module's own parameters, so no gradient flows twice.
    """
    for module, x, out, grad in reversed(pending.nodes):
        params = [p for p in module.parameters(recurse=False) if p.requires_grad]
        if out is None:
            assert isinstance(module, nn.Linear), "only Linears defer their W without graph"
            values = linear_weight_grads(module, x, grad)
        else:
            values = list(torch.autograd.grad(out, params, grad))
        accumulate(params if master is None else [master(p) for p in params], values)


def accumulate(params: Sequence[nn.Parameter], values: Sequence[torch.Tensor | None]) -> None:
    """Add each value to its parameter's `.grad` as autograd's AccumulateGrad would (a
    low-precision copy's gradient widened by the add, as `WeightCopies` does), or into its
    fp32 `main_grad` under ZeRO (`engine.parallel`)."""
    for param, value in zip(params, values, strict=True):
        if value is None:
            continue
        main = getattr(param, "main_grad", None)  # ZeRO's fp32 accumulation buffer
        if main is not None:
            main.add_(local_gradient(param, value))
            continue
        value = as_gradient_of(param, value)
        if param.grad is None:
            param.grad = value.to(param.dtype)
        else:
            param.grad += value


def linear_weight_grads(
    module: nn.Linear, x: torch.Tensor, grad: torch.Tensor
) -> list[torch.Tensor]:
    """A Linear's weight (and bias) gradient as the GEMM autograd runs: gᵀ·x (and Σ g).

    The same kernels on the same operands as autograd's AddmmBackward, so the same bits,
    without an autograd call per module (the W pass's main overhead).
    """
    weight = local_tensor(module.weight)  # a tp shard's GEMM is on local tensors
    out_features, in_features = weight.shape
    g2d = local_tensor(grad).reshape(-1, out_features)
    values = [g2d.t().mm(local_tensor(x.detach()).reshape(-1, in_features))]
    if module.bias is not None and module.bias.requires_grad:
        values.append(g2d.sum(0))
    return values
