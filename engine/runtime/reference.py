"""The single-process reference step: every pipeline result is compared with this.

Gradient accumulation runs micro-batch by micro-batch in order, each micro-batch loss scaled by
1/m before its backward, exactly as the last pipeline stage does; so with DP = 1 a pipelined
step can reproduce it bit for bit.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from engine.runtime.clipping import clip_gradients, global_grad_norm
from engine.runtime.micro_batches import LossFn, split_micro_batches
from engine.runtime.precision import LossScaler, autocast
from models import document_scope, lm_loss

__all__ = ["accumulate_gradients", "reference_step"]


def accumulate_gradients(
    model: nn.Module,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    *,
    micro_batches: int,
    loss_fn: LossFn = lm_loss,
    precision: str = "fp32",
    loss_scale: float = 1.0,
    documents: torch.Tensor | None = None,
) -> torch.Tensor:
    """Forward and backward each micro-batch in order; returns the mean loss (detached).

    Gradients accumulate into `.grad` (set them to None first for a fresh step). `documents`:
    the batch's document ids when documents are packed (`models.documents`).
    """
    losses = []
    device = next(model.parameters()).device
    doc_slices = (
        split_micro_batches(documents, micro_batches)
        if documents is not None
        else (None,) * micro_batches
    )
    for x, y, docs in zip(
        split_micro_batches(inputs, micro_batches),
        split_micro_batches(targets, micro_batches),
        doc_slices,
        strict=True,
    ):
        with autocast(precision, device), document_scope(docs):
            loss = loss_fn(model(x), y)
        root = loss / micro_batches
        (root if loss_scale == 1.0 else root * loss_scale).backward()
        losses.append(loss.detach())
    return torch.stack(losses).mean()


def reference_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    *,
    micro_batches: int,
    loss_fn: LossFn = lm_loss,
    clip_grad_norm: float = 0.0,
    precision: str = "fp32",
    scaler: LossScaler | None = None,
    documents: torch.Tensor | None = None,
) -> float:
    """One optimizer step over a global batch with gradient accumulation; returns the loss.

    Clipping, the non-finite skip and fp16 loss scaling follow the same rules, through the
    same functions, as the pipeline engine.
    """
    optimizer.zero_grad(set_to_none=True)
    scale = scaler.scale if scaler is not None else 1.0
    loss = accumulate_gradients(
        model,
        inputs,
        targets,
        micro_batches=micro_batches,
        loss_fn=loss_fn,
        precision=precision,
        loss_scale=scale,
        documents=documents,
    )
    params = list(model.parameters())
    if scale != 1.0:
        for param in params:
            if param.grad is not None:
                param.grad.mul_(1.0 / scale)
    named = list(model.named_parameters())
    total = global_grad_norm(named, {name: i for i, (name, _) in enumerate(named)})
    finite = math.isfinite(float(total)) and math.isfinite(float(loss))
    if finite:
        if clip_grad_norm > 0:
            clip_gradients(params, total, clip_grad_norm)
        optimizer.step()
    if scaler is not None:
        scaler.update(finite)
    return float(loss)
