"""The single-process reference step: every pipeline result is compared with this.

Gradient accumulation runs micro-batch by micro-batch in order, each micro-batch loss scaled by
1/m before its backward, exactly as the last pipeline stage does; so with DP = 1 a pipelined
step can reproduce it bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from models import lm_loss

__all__ = ["LossFn", "accumulate_gradients", "reference_step", "split_micro_batches"]

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def split_micro_batches(batch: torch.Tensor, micro_batches: int) -> tuple[torch.Tensor, ...]:
    """Split along dim 0 into `micro_batches` equal slices (views, no copy)."""
    if micro_batches < 1:
        raise ValueError(f"micro_batches={micro_batches} must be at least 1")
    size = batch.shape[0]
    if size % micro_batches:
        raise ValueError(
            f"a batch of {size} sequences does not split into {micro_batches} equal "
            f"micro-batches: use a batch that is a multiple of {micro_batches} or change "
            "the number of micro-batches"
        )
    return batch.split(size // micro_batches)


def accumulate_gradients(
    model: nn.Module,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    *,
    micro_batches: int,
    loss_fn: LossFn = lm_loss,
) -> torch.Tensor:
    """Forward and backward each micro-batch in order; returns the mean loss (detached).

    Gradients accumulate into `.grad` (set them to None first for a fresh step).
    """
    losses = []
    for x, y in zip(
        split_micro_batches(inputs, micro_batches),
        split_micro_batches(targets, micro_batches),
        strict=True,
    ):
        loss = loss_fn(model(x), y)
        (loss / micro_batches).backward()
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
) -> float:
    """One optimizer step over a global batch with gradient accumulation; returns the loss."""
    optimizer.zero_grad(set_to_none=True)
    loss = accumulate_gradients(
        model, inputs, targets, micro_batches=micro_batches, loss_fn=loss_fn
    )
    optimizer.step()
    return float(loss)
