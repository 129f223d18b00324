"""A deterministic batch loader over a token file.

The loader draws each global batch from ``(seed, step)`` alone, so a pipelined, data-parallel run
and a single-process reference see exactly the same tokens at every step, and a resumed run
continues with the batches an uninterrupted run would have seen.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from engine.training.data import TokenDataset

__all__ = ["BatchLoader"]


def _check_positive(name: str, value: int, fix: str) -> None:
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive int; {fix}")


class BatchLoader:
    """Random windows of a token file; the global batch at step k depends only on (seed, k).

    DP rank r takes rows ``[r*b, (r+1)*b)`` of the global batch (``b = global_batch // dp_size``),
    so the ranks' batches concatenated in rank order equal the ``dp_size=1`` batch.
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
        if len(dataset) < seq_len + 1:
            raise ValueError(
                f"{str(dataset.info.bin_path)!r} has {len(dataset)} tokens, too short for "
                f"seq_len={seq_len} (needs >= {seq_len + 1}); use a shorter seq_len or more data"
            )
        self.dataset = dataset
        self.seq_len, self.global_batch, self.seed = seq_len, global_batch, seed
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.local_batch = global_batch // dp_size
        self._position = 0

    @property
    def position(self) -> int:
        """The step whose batch ``next_batch`` returns next."""
        return self._position

    def batch_at(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's (inputs, targets) for ``step``, int64 of shape (local_batch, seq_len)."""
        if not isinstance(step, int) or step < 0:
            raise ValueError(f"step={step!r} must be a non-negative int")
        rng = np.random.default_rng([self.seed, step])
        starts = rng.integers(0, len(self.dataset) - self.seq_len, size=self.global_batch)
        rows = starts[self.dp_rank * self.local_batch : (self.dp_rank + 1) * self.local_batch]
        windows = self.dataset.tokens[rows[:, None] + np.arange(self.seq_len + 1)]
        chunk = torch.from_numpy(windows.astype(np.int64))
        return chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()

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
        position = state.get("position")
        if not isinstance(position, int) or position < 0:
            raise ValueError(f"loader state position={position!r} must be a non-negative int")
        self._position = position
