"""The model a run trains or a layout sizes."""

from __future__ import annotations

from dataclasses import dataclass

from models import LayerSpec, ModelConfig, get_config, layer_specs

__all__ = ["ModelChoice"]


@dataclass(frozen=True, kw_only=True)
class ModelChoice:
    """Which model: a registered name (`models.MODEL_CONFIGS`)."""

    model: str = "gpt-tiny"
    """Name of a registered model config (see `models.MODEL_CONFIGS`)."""

    def __post_init__(self) -> None:
        get_config(self.model)

    def config(self) -> ModelConfig:
        return get_config(self.model)

    def specs(self) -> list[LayerSpec]:
        """The model's layer list (built on demand, nothing allocated)."""
        return layer_specs(self.model)
