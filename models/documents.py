"""Packed documents: several documents in one sequence, each attending only to itself and
counting its positions from 0.

Which document each token belongs to is a (batch, seq) int tensor, equal ids within a
document. Layers map one tensor to one tensor, so the ids reach them through a scope rather
than as an argument: a pipeline stage (or the single-process reference) opens
`document_scope` around its layers for each micro-batch, and again around a backward that
recomputes them. Every stage derives the same ids from the micro-batch, so they never travel
with the activations and no message changes shape.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["current_documents", "document_mask", "document_positions", "document_scope"]

_current: list[torch.Tensor | None] = [None]


@contextlib.contextmanager
def document_scope(documents: torch.Tensor | None) -> Iterator[None]:
    """Layers run inside see `documents` (None: one document per sequence, the default)."""
    if documents is not None and documents.dim() != 2:
        raise ValueError(
            f"documents of shape {tuple(documents.shape)}: give a (batch, seq) tensor of "
            "document ids, one per token"
        )
    _current.append(documents)
    try:
        yield
    finally:
        _current.pop()


def current_documents() -> torch.Tensor | None:
    """The document ids of the innermost `document_scope`, or None outside any."""
    return _current[-1]


def document_positions(documents: torch.Tensor) -> torch.Tensor:
    """Each token's position within its document: (batch, seq) int64, 0 at each start."""
    seq = documents.shape[1]
    index = torch.arange(seq, device=documents.device).expand_as(documents)
    starts = torch.ones_like(documents, dtype=torch.bool)
    starts[:, 1:] = documents[:, 1:] != documents[:, :-1]
    first = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values
    return index - first


def document_mask(documents: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """(batch, 1, seq, seq) booleans: query i sees key j <= i of its own document (and, with
    a sliding `window`, only the `window - 1` keys before it)."""
    seq = documents.shape[1]
    index = torch.arange(seq, device=documents.device)
    back = index[:, None] - index[None, :]
    allowed = back >= 0
    if window is not None:
        allowed = allowed & (back < window)
    same = documents[:, :, None] == documents[:, None, :]
    return (same & allowed)[:, None]
