"""Micro-batches: how a step's batch is sliced, and the loss each slice's output is scored by.

The engine, the single-process reference and the DeepSpeed peer slice the same way, so their
micro-batches hold the same rows.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["LossFn", "split_micro_batches"]

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
