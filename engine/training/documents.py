"""Documents of a token file: the units an epoch shuffles, a validation split holds out and
`--pack-documents` keeps apart in attention.

A file whose header names an ``eos_id`` is a sequence of documents, each ending with that token
(the last one may lack it). A file without one (the byte tokenizer's) is one stream: a single
document, split for validation by a contiguous range of tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from engine.training.data import TokenDataset

__all__ = ["VALIDATION_SEED", "Documents", "documents_of", "split_validation"]

VALIDATION_SEED = 0
"""Seed of the held-out documents: fixed, so runs of any --seed compare on the same split."""


@dataclass(frozen=True, eq=False)
class Documents:
    """Some documents of a token file, as (start, length) pairs in file order."""

    tokens: npt.NDArray[Any]
    """The whole file's tokens (memory-mapped)."""
    starts: npt.NDArray[np.int64]
    """Where each document starts in `tokens`."""
    lengths: npt.NDArray[np.int64]
    """How many tokens each document holds (its EOS included)."""
    separated: bool
    """Whether the file marks document ends (an EOS id); False: one stream of tokens."""

    def __len__(self) -> int:
        return len(self.starts)

    @property
    def num_tokens(self) -> int:
        """Tokens in all these documents."""
        return int(self.lengths.sum())

    def subset(self, keep: npt.NDArray[np.bool_]) -> Documents:
        """The documents where `keep` is true, in file order."""
        return Documents(self.tokens, self.starts[keep], self.lengths[keep], self.separated)


def documents_of(dataset: TokenDataset) -> Documents:
    """The file's documents: each ends after an EOS token, or the whole file when it has none."""
    n, eos = len(dataset), dataset.info.eos_id
    if eos is None:
        return Documents(dataset.tokens, _int64([0]), _int64([n]), separated=False)
    ends = np.flatnonzero(np.asarray(dataset.tokens) == eos) + 1
    if not len(ends) or ends[-1] != n:
        ends = np.append(ends, n)
    starts = np.concatenate([[0], ends[:-1]])
    return Documents(dataset.tokens, _int64(starts), _int64(ends - starts), separated=True)


def split_validation(documents: Documents, fraction: float) -> tuple[Documents, Documents]:
    """(training, validation): `fraction` of the documents held out, drawn with the fixed
    `VALIDATION_SEED`; a file of one stream holds out its last `fraction` of tokens instead."""
    if not 0 < fraction < 1:
        raise ValueError(f"val_fraction={fraction} must lie in (0, 1), e.g. 0.05")
    count = len(documents)
    if documents.separated and count >= 2:
        held = min(count - 1, max(1, math.ceil(fraction * count)))
        chosen = np.random.default_rng(VALIDATION_SEED).permutation(count)[:held]
        keep = np.zeros(count, dtype=np.bool_)
        keep[chosen] = True
        return documents.subset(~keep), documents.subset(keep)
    start, total = int(documents.starts[0]), documents.num_tokens
    cut = total - max(1, math.ceil(fraction * total))

    def part(offset: int, length: int) -> Documents:
        return Documents(documents.tokens, _int64([offset]), _int64([length]), separated=False)

    return part(start, cut), part(start + cut, total - cut)


def _int64(values: Any) -> npt.NDArray[np.int64]:
    return np.asarray(values, dtype=np.int64)
