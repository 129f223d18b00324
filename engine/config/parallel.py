"""How many ranks a run spans: pipeline stages × data-parallel replicas × tensor-parallel
ranks, and the tensor-parallel split a model must allow."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.config.fields import flat, require

__all__ = ["MESH_DIMS", "ParallelConfig", "check_tensor_parallel_shape", "parse_mesh_order"]

MESH_DIMS = ("pp", "dp", "tp")
"""The grid's dimensions in the default rank order, outermost first (Megatron's: tp ranks
neighbours on one host, pipeline stages furthest apart)."""


def parse_mesh_order(text: Any) -> tuple[str, ...]:
    """A rank order from its flat form, `pp,dp,tp` (outermost first): a permutation of the
    three dimensions."""
    order = tuple(text) if isinstance(text, tuple | list) else tuple(str(text).split(","))
    order = tuple(dim.strip() for dim in order)
    require(
        sorted(order) == sorted(MESH_DIMS),
        f"mesh_order={text!r} is not an order of the dimensions pp, dp and tp: give each once, "
        "outermost first, such as pp,dp,tp (the default) or dp,pp,tp",
    )
    return order


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """The mesh's degrees: pp pipeline ranks per replica, dp replicas, tp ranks splitting
    every layer of a stage. World size is pp · dp · tp; `mesh_order` lays them out in the
    global rank, tp innermost and pp outermost by default."""

    pp: int = 1
    """Pipeline stages (ranks per pipeline)."""
    dp: int = 1
    """Data-parallel replicas of the pipeline."""
    tp: int = 1
    """Tensor-parallel ranks per stage: attention split by heads, the MLP by its hidden size,
    embedding and LM head by vocabulary."""
    mesh_order: tuple[str, ...] = field(
        default=MESH_DIMS, metadata=flat(parse=parse_mesh_order, text=",".join)
    )
    """Rank order of the grid's dimensions, outermost first: global rank = ((a_rank · B +
    b_rank) · C + c_rank) for the order a,b,c. The default pp,dp,tp keeps a stage's tp and dp
    ranks on one host and lets pipeline edges cross hosts; the order changes where ranks sit,
    never the results."""

    def __post_init__(self) -> None:
        for name in MESH_DIMS:
            value = getattr(self, name)
            require(isinstance(value, int) and value >= 1, f"{name}={value!r} must be at least 1")
        object.__setattr__(self, "mesh_order", parse_mesh_order(self.mesh_order))

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
