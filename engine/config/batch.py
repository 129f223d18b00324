"""What one optimizer step consumes: sequences of a fixed length, over all replicas."""

from __future__ import annotations

from dataclasses import dataclass

from engine.config.fields import require

__all__ = ["BatchConfig"]


@dataclass(frozen=True, kw_only=True)
class BatchConfig:
    """The global batch and its sequence length."""

    global_batch: int = 16
    """Sequences per optimizer step, over all data-parallel replicas."""
    seq_len: int = 128
    """Tokens per sequence; at most the model's context."""

    def __post_init__(self) -> None:
        for name in ("global_batch", "seq_len"):
            value = getattr(self, name)
            require(value >= 1, f"{name}={value} must be at least 1")

    def micro_batch_size(self, dp: int, micro_batches: int) -> int:
        """Sequences per micro-batch: the global batch over replicas × micro-batches."""
        require(
            self.global_batch % (dp * micro_batches) == 0,
            f"global batch {self.global_batch} does not split into {micro_batches} "
            f"micro-batches on each of {dp} replica(s): use a multiple of {dp * micro_batches}",
        )
        return self.global_batch // (dp * micro_batches)
