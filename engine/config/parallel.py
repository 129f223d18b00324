"""How many ranks a run spans: pipeline stages × data-parallel replicas × tensor-parallel
ranks, and the tensor-parallel split a model must allow."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.config.fields import require

__all__ = ["ParallelConfig", "check_tensor_parallel_shape"]


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """The mesh's degrees: pp pipeline ranks per replica, dp replicas, tp ranks splitting
    every layer of a stage. World size is pp · dp · tp; tp is the innermost dimension."""

    pp: int = 1
    """Pipeline stages (ranks per pipeline)."""
    dp: int = 1
    """Data-parallel replicas of the pipeline."""
    tp: int = 1
    """Tensor-parallel ranks per stage: attention split by heads, the MLP by its hidden size,
    embedding and LM head by vocabulary."""

    def __post_init__(self) -> None:
        for name in ("pp", "dp", "tp"):
            value = getattr(self, name)
            require(isinstance(value, int) and value >= 1, f"{name}={value!r} must be at least 1")

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.tp


def check_tensor_parallel_shape(model: str, config: Any, tp: int) -> None:
    """Refuse a model whose heads, kv heads, hidden size, MLP size or vocabulary `tp` does not
    divide: each tp rank holds an equal slice of each."""
    if tp == 1:
        return
    sizes = {
        "attention heads (n_head)": config.n_head,
        "key/value heads (n_kv_head)": getattr(config, "n_kv_head", config.n_head),
        "hidden size (d_model)": config.d_model,
        "MLP size": getattr(config, "ffn_hidden", None) or 4 * config.d_model,
        "vocabulary (vocab_size)": config.vocab_size,
    }
    for what, size in sizes.items():
        if size % tp:
            fits = [t for t in range(1, size + 1) if size % t == 0 and t <= 64]
            require(
                False,
                f"--tp {tp} does not divide {model}'s {what} of {size}: every tensor-parallel "
                f"rank holds an equal share; choose --tp among {fits[:12]}",
            )
