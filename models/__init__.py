"""Decoder LLMs as layer lists: GPT-2 and Llama families, built stage by stage."""

from models.documents import document_scope
from models.gpt import GPTConfig
from models.layers import LayerSpec
from models.llama import LlamaConfig
from models.registry import MODEL_CONFIGS, ModelConfig, get_config, layer_specs
from models.stack import LayerStack, build_layers, lm_loss

__all__ = [
    "MODEL_CONFIGS",
    "GPTConfig",
    "LayerSpec",
    "LayerStack",
    "LlamaConfig",
    "ModelConfig",
    "build_layers",
    "document_scope",
    "get_config",
    "layer_specs",
    "lm_loss",
]
