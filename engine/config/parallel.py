"""How many ranks a run spans: pipeline stages times data-parallel replicas."""

from __future__ import annotations

from dataclasses import dataclass

from engine.config.fields import require

__all__ = ["ParallelConfig"]


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """The mesh's degrees: pp pipeline ranks per replica, dp replicas."""

    pp: int = 1
    """Pipeline stages (ranks per pipeline)."""
    dp: int = 1
    """Data-parallel replicas of the pipeline."""

    def __post_init__(self) -> None:
        for name in ("pp", "dp"):
            value = getattr(self, name)
            require(value >= 1, f"{name}={value} must be at least 1")

    @property
    def world_size(self) -> int:
        return self.pp * self.dp
