"""The model a run trains or a layout sizes."""

from __future__ import annotations

from dataclasses import dataclass

from engine.config.fields import require
from models import LayerSpec, ModelConfig, get_config, layer_specs
from models.config_file import read_model_config

__all__ = ["ModelChoice"]


@dataclass(frozen=True, kw_only=True)
class ModelChoice:
    """Which model: a registered name, a Hugging Face folder's shape, or a file of fields."""

    model: str = "gpt-tiny"
    """Name of a registered model config (see `models.MODEL_CONFIGS`), or hf:DIR for the shape
    of the Hugging Face model in DIR."""
    model_config: str | None = None
    """A JSON file of the model's fields (`{"family": "gpt" or "llama", "vocab_size": …}`, the
    fields of GPTConfig or LlamaConfig) or a Hugging Face config.json; replaces --model."""

    def __post_init__(self) -> None:
        require(
            self.model_config is None or self.model == ModelChoice.model,
            f"--model {self.model} and --model-config {self.model_config} both name the "
            "model: give one of them",
        )
        self.config()

    @property
    def name(self) -> str:
        """How messages name the model: its registered name or its file."""
        return self.model_config or self.model

    def config(self) -> ModelConfig:
        if self.model_config is not None:
            return read_model_config(self.model_config)
        return get_config(self.model)

    def specs(self) -> list[LayerSpec]:
        """The model's layer list (built on demand, nothing allocated)."""
        return layer_specs(self.config())
