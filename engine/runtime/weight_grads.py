"""A split backward's two passes: the I pass's one autograd call (`split_input_grads`), and
the W half, each deferred Linear's weight gradient accumulated where autograd's fused backward
would have put it.

`PipelineStage.backward_input` (the I half) records, per micro-batch, every Linear's input and
its output's gradient; `run_weight_grads` takes them later, when the schedule runs the W.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import GradientEdge

from engine.parallel import as_gradient_of, local_gradient, local_tensor
from models import LayerSpec

__all__ = [
    "PendingWeightGrad",
    "Recorded",
    "accumulate",
    "linear_weight_grads",
    "run_weight_grads",
    "runs_whole_backward_at_input",
    "split_input_grads",
]

Recorded = tuple[nn.Module, torch.Tensor, GradientEdge]
"""A Linear recorded for its W: the module, its input in the GEMM's dtype (detached), its
output's gradient edge (`engine.runtime.linear_records`)."""


@dataclass
class PendingWeightGrad:
    nodes: list[tuple[nn.Module, torch.Tensor, torch.Tensor]]
    """(Linear, input in the GEMM's dtype, gradient at the output) waiting for their W."""


def runs_whole_backward_at_input(specs: Sequence[LayerSpec], layers: range, recompute: str) -> bool:
    """Whether a stage of these layers runs a split backward whole at I, its W empty
    (`PipelineStage.enable_split_backward`): it recomputes (each per-module W would run the
    checkpointed forward again), or it holds both ends of a tied weight (one parameter that
    two modules use, whose W cannot be taken per module). For the planner's prices and the
    launcher's note, before any stage is built."""
    keys = [specs[i].tie_key for i in layers if specs[i].tie_key is not None]
    return recompute != "none" or len(keys) != len(set(keys))


def split_input_grads(
    roots: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor] | None,
    inputs: Sequence[torch.Tensor],
    recorded: Sequence[Recorded],
    eager: Sequence[nn.Parameter],
) -> tuple[tuple[torch.Tensor, ...], PendingWeightGrad]:
    """The I pass: one autograd call for the gradients of the stage's inputs, of every recorded
    Linear's output (kept for W) and of the `eager` parameters (accumulated now); returns the
    input gradients found and what the micro-batch's W needs. W computes each Linear's weight
    gradient itself from (input, output gradient), so the graph is freed here."""
    wanted = [x for x in inputs if x.requires_grad]
    nodes = [out for _, _, out in recorded]
    targets: list[Any] = [*wanted, *nodes, *eager]  # autograd takes tensors and edges mixed
    found = torch.autograd.grad(roots, targets, grad_outputs=grads, allow_unused=True)
    cut = len(wanted) + len(nodes)
    input_grads, node_grads = found[: len(wanted)], found[len(wanted) : cut]
    accumulate(eager, found[cut:])
    pending = PendingWeightGrad(
        [(m, x, g) for (m, x, _), g in zip(recorded, node_grads, strict=True) if g is not None]
    )
    return tuple(g for g in input_grads if g is not None), pending


def run_weight_grads(
    pending: PendingWeightGrad, master: Callable[[nn.Parameter], nn.Parameter] | None
) -> None:
    """Each Linear's parameter gradients from its output's gradient, into `master(p)` (the
    fp32 parameter behind a low-precision copy) or `p` itself.

    Modules go last-to-first, the order a fused backward reaches them; each is the very GEMM
    autograd would run (same operands, same bits): in the compute dtype under autocast, on
    the local shards under tensor parallelism.
    """
    for module, x, grad in reversed(pending.nodes):
        assert isinstance(module, nn.Linear), "only Linears defer their W"
        params = [p for p in module.parameters(recurse=False) if p.requires_grad]
        values = linear_weight_grads(module, x, grad)
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
