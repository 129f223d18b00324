"""A deterministic batch loader over a token file.

The loader draws each global batch from ``(seed, step)`` alone, so a pipelined, data-parallel run
and a single-process reference see exactly the same tokens at every step, and a resumed run
continues with the batches an uninterrupted run would have seen, in any layout.

Two orders: ``epochs`` (the default) passes over the data in a shuffled order without
replacement: epoch ``e`` shuffles the documents and then the windows cut from their
concatenation, both from ``(seed, e)``; ``random`` draws every window's start uniformly
(with replacement, the order of meshpipe before epochs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from engine.config import DATA_ORDERS
from engine.training.data import TokenDataset
from engine.training.documents import Documents, documents_of

__all__ = ["Batch", "BatchLoader"]


def _check_length(dataset: TokenDataset, documents: Documents, seq_len: int) -> None:
    if documents.num_tokens < seq_len + 1:
        raise ValueError(
            f"{str(dataset.info.bin_path)!r} has {documents.num_tokens} tokens to draw from, too "
            f"short for seq_len={seq_len} (needs >= {seq_len + 1}); use a shorter seq_len or "
            "more data"
        )


def _check_arguments(
    seq_len: int, global_batch: int, seed: int, dp_rank: int, dp_size: int, order: str
) -> None:
    _check_positive("seq_len", seq_len, "use the model's context length")
    _check_positive("global_batch", global_batch, "use the number of sequences per step")
    _check_positive("dp_size", dp_size, "use the data-parallel world size")
    if not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed={seed!r} must be a non-negative int")
    if global_batch % dp_size:
        raise ValueError(
            f"global_batch={global_batch} is not divisible by dp_size={dp_size}; "
            f"use a multiple of {dp_size}"
        )
    if not isinstance(dp_rank, int) or not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank={dp_rank!r} is out of range; use 0..{dp_size - 1}")
    if order not in DATA_ORDERS:
        raise ValueError(f"data order {order!r} is unknown; use one of {DATA_ORDERS}")


def _check_positive(name: str, value: int, fix: str) -> None:
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive int; {fix}")


@dataclass(frozen=True)
class Batch:
    """One rank's rows of a step: int64 tensors of shape (local_batch, seq_len)."""

    inputs: torch.Tensor
    targets: torch.Tensor
    documents: torch.Tensor | None = None
    """Which document each input token belongs to (ids equal within a document), when the
    loader packs documents; None otherwise."""


@dataclass(frozen=True, eq=False)
class _Stream:
    """The documents concatenated in some order: where each one starts in the file and where
    it ends in the concatenation."""

    starts: npt.NDArray[np.int64]
    ends: npt.NDArray[np.int64]
    lengths: npt.NDArray[np.int64]
    windows: npt.NDArray[np.int64]
    """Epoch order: the windows (index k covers tokens [k·seq_len, (k+1)·seq_len]) in the
    order they are drawn."""


class BatchLoader:
    """Windows of a token file; the global batch at step k depends only on (seed, k).

    DP rank r takes rows ``[r*b, (r+1)*b)`` of the global batch (``b = global_batch // dp_size``),
    so the ranks' batches concatenated in rank order equal the ``dp_size=1`` batch.
    `documents` restricts the loader to some of the file's documents (a validation split);
    `pack_documents` also returns each token's document (`Batch.documents`).
    """

    def __init__(
        self,
        dataset: TokenDataset,
        *,
        seq_len: int,
        global_batch: int,
        seed: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        order: str = "epochs",
        documents: Documents | None = None,
        pack_documents: bool = False,
    ) -> None:
        _check_arguments(seq_len, global_batch, seed, dp_rank, dp_size, order)
        self.documents = documents_of(dataset) if documents is None else documents
        _check_length(dataset, self.documents, seq_len)
        if pack_documents and not self.documents.separated:
            raise ValueError(
                f"--pack-documents needs document boundaries, but {str(dataset.info.bin_path)!r} "
                "has no eos_id (the byte tokenizer has no end-of-document token): prepare the "
                "data with a tokenizer that has an EOS token (`meshpipe data prepare SRC "
                "--tokenizer PATH`), or train without --pack-documents"
            )
        self.dataset, self.order, self.pack_documents = dataset, order, pack_documents
        self.seq_len, self.global_batch, self.seed = seq_len, global_batch, seed
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.local_batch = global_batch // dp_size
        self.windows_per_epoch = (self.documents.num_tokens - 1) // seq_len
        self._position = 0
        self._streams: dict[int | None, _Stream] = {}

    @property
    def position(self) -> int:
        """The step whose batch ``next_batch`` returns next."""
        return self._position

    def batch_at(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's (inputs, targets) for ``step``, int64 of shape (local_batch, seq_len)."""
        batch = self.sample(step)
        return batch.inputs, batch.targets

    def sample(self, step: int) -> Batch:
        """This rank's rows of ``step``, with their documents when packing."""
        if not isinstance(step, int) or step < 0:
            raise ValueError(f"step={step!r} must be a non-negative int")
        rows = slice(self.dp_rank * self.local_batch, (self.dp_rank + 1) * self.local_batch)
        if self.order == "random":
            rng = np.random.default_rng([self.seed, step])
            total = self.documents.num_tokens
            starts = rng.integers(0, total - self.seq_len, size=self.global_batch)[rows]
            tokens, docs = self._gather(self._stream(None), starts)
        else:
            drawn = step * self.global_batch + np.arange(self.global_batch)[rows]
            epochs, index = np.divmod(drawn, self.windows_per_epoch)
            tokens = np.empty((len(drawn), self.seq_len + 1), dtype=np.int64)
            docs = np.empty_like(tokens)
            for epoch in np.unique(epochs):
                mine = epochs == epoch
                stream = self._stream(int(epoch))
                starts = stream.windows[index[mine]] * self.seq_len
                tokens[mine], docs[mine] = self._gather(stream, starts)
        chunk = torch.from_numpy(tokens)
        documents = torch.from_numpy(docs[:, :-1].copy()) if self.pack_documents else None
        return Batch(chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous(), documents)

    def _stream(self, epoch: int | None) -> _Stream:
        """The documents in file order (None) or in epoch `epoch`'s shuffled order."""
        if epoch in self._streams:
            return self._streams[epoch]
        docs = self.documents
        order = np.arange(len(docs))
        windows = np.arange(0)
        if epoch is not None:
            rng = np.random.default_rng([self.seed, epoch])
            order = rng.permutation(len(docs))
            windows = rng.permutation(self.windows_per_epoch)
        lengths = docs.lengths[order]
        stream = _Stream(docs.starts[order], np.cumsum(lengths), lengths, windows)
        if len(self._streams) >= 2:  # a step's rows mostly lie in one epoch, or two
            self._streams.pop(next(iter(self._streams)))
        self._streams[epoch] = stream
        return stream

    def _gather(
        self, stream: _Stream, starts: npt.NDArray[np.int64]
    ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        """Tokens [start, start + seq_len] of the stream for each start, and the index (in
        the stream) of the document each token comes from."""
        at = starts[:, None] + np.arange(self.seq_len + 1)
        doc = np.searchsorted(stream.ends, at, side="right")
        source = stream.starts[doc] + at - (stream.ends[doc] - stream.lengths[doc])
        return self.documents.tokens[source].astype(np.int64), doc.astype(np.int64)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch at ``position``, then advance by one step."""
        batch = self.batch_at(self._position)
        self._position += 1
        return batch

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint needs to resume; the DP layout is left out, so it may change."""
        state: dict[str, Any] = {
            "position": self._position,
            "seed": self.seed,
            "seq_len": self.seq_len,
            "global_batch": self.global_batch,
            "tokens": len(self.dataset),
            "order": self.order,
            "drawn_from": [len(self.documents), self.documents.num_tokens],
        }
        if self.dataset.info.sha256 is not None:
            state["sha256"] = self.dataset.info.sha256
        return state

    def _check_same_tokens(self, state: dict[str, Any]) -> None:
        """The batches are windows at offsets drawn over the file's length: other tokens (a
        re-prepared file under the same name) would silently train on other batches. A state or
        a file from before these fields were recorded is checked as far as it can be."""
        info = self.dataset.info
        count, digest = state.get("tokens"), state.get("sha256")
        other_count = count is not None and count != len(self.dataset)
        other_digest = None not in (digest, info.sha256) and digest != info.sha256
        if other_count or other_digest:
            raise ValueError(
                f"the checkpoint was trained on {count} tokens (sha256 {digest}) but "
                f"{str(info.bin_path)!r} now holds {len(self.dataset)} (sha256 {info.sha256}): "
                "the token file changed since; resume with the data it was trained on, or start "
                "a new run from its weights with --init-from"
            )

    def _check_same_order(self, state: dict[str, Any]) -> None:
        """The order and the documents drawn from (a validation split takes some away) make
        the batches; a state from before epochs was drawn in random order."""
        order = state.get("order", "random")
        if order != self.order:
            raise ValueError(
                f"the checkpoint drew its batches in {order!r} order but this run asks for "
                f"{self.order!r}: resume with --data-order {order}, or start a new run from "
                "its weights with --init-from"
            )
        drawn = state.get("drawn_from")
        mine = [len(self.documents), self.documents.num_tokens]
        if drawn is not None and list(drawn) != mine:
            raise ValueError(
                f"the checkpoint drew its batches from {drawn[0]} documents ({drawn[1]} tokens) "
                f"but this run draws from {mine[0]} ({mine[1]} tokens): the validation split "
                "changed; resume with the checkpoint's --val-fraction, or start a new run from "
                "its weights with --init-from"
            )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at ``state["position"]``; refuse a state drawn with a different batch recipe."""
        for key in ("seed", "seq_len", "global_batch"):
            if key not in state:
                raise ValueError(f"loader state lacks {key!r}; pass a BatchLoader.state_dict()")
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"loader state has {key}={state[key]!r} but this loader has "
                    f"{key}={getattr(self, key)!r}; build the loader with {key}={state[key]!r}"
                )
        self._check_same_tokens(state)
        self._check_same_order(state)
        position = state.get("position")
        if not isinstance(position, int) or position < 0:
            raise ValueError(f"loader state position={position!r} must be a non-negative int")
        self._position = position
