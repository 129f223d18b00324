"""Named model configs: tiny ones for tests and examples, real shapes for planning."""

from __future__ import annotations

from models.config_file import HF_PREFIX, read_model_config
from models.gpt import GPTConfig
from models.layers import LayerSpec
from models.llama import LlamaConfig

__all__ = ["MODEL_CONFIGS", "ModelConfig", "get_config", "layer_specs"]

ModelConfig = GPTConfig | LlamaConfig

MODEL_CONFIGS: dict[str, ModelConfig] = {
    # Tiny shapes: a few hundred thousand parameters, for tests and laptops.
    "gpt-tiny": GPTConfig(vocab_size=256, n_layer=4, n_head=4, d_model=64, max_seq_len=128),
    "gpt-small": GPTConfig(vocab_size=256, n_layer=8, n_head=4, d_model=128, max_seq_len=256),
    # The peer benchmark's model (issue "faster than the peers").
    "gpt-bench": GPTConfig(vocab_size=256, n_layer=8, n_head=8, d_model=256, max_seq_len=128),
    "llama-tiny": LlamaConfig(
        vocab_size=256,
        n_layer=4,
        n_head=4,
        n_kv_head=2,
        d_model=64,
        ffn_hidden=176,
        max_seq_len=128,
    ),
    # Real shapes, built on the meta device for planning and profiling.
    "gpt2": GPTConfig(vocab_size=50257, n_layer=12, n_head=12, d_model=768, max_seq_len=1024),
    "gpt2-medium": GPTConfig(
        vocab_size=50257, n_layer=24, n_head=16, d_model=1024, max_seq_len=1024
    ),
    "gpt2-large": GPTConfig(
        vocab_size=50257, n_layer=36, n_head=20, d_model=1280, max_seq_len=1024
    ),
    "gpt2-xl": GPTConfig(vocab_size=50257, n_layer=48, n_head=25, d_model=1600, max_seq_len=1024),
    # TinyLlama-1.1B's shape: a Llama-2 architecture with untied head and GQA.
    "llama-1b": LlamaConfig(
        vocab_size=32000,
        n_layer=22,
        n_head=32,
        n_kv_head=4,
        d_model=2048,
        ffn_hidden=5632,
        max_seq_len=2048,
    ),
    "llama-7b": LlamaConfig(
        vocab_size=32000,
        n_layer=32,
        n_head=32,
        n_kv_head=32,
        d_model=4096,
        ffn_hidden=11008,
        max_seq_len=4096,
    ),
    "llama-13b": LlamaConfig(
        vocab_size=32000,
        n_layer=40,
        n_head=40,
        n_kv_head=40,
        d_model=5120,
        ffn_hidden=13824,
        max_seq_len=4096,
    ),
    "llama-70b": LlamaConfig(
        vocab_size=32000,
        n_layer=80,
        n_head=64,
        n_kv_head=8,
        d_model=8192,
        ffn_hidden=28672,
        max_seq_len=4096,
    ),
    # Llama 3's shapes (128K vocabulary, GQA with 8 kv heads, rope base 500000), the models
    # people size today; 8192 positions as Llama 3 was pretrained (3.1's long-context rope
    # scaling is not modelled: these shapes are for planning and memory).
    "llama3-8b": LlamaConfig(
        vocab_size=128256,
        n_layer=32,
        n_head=32,
        n_kv_head=8,
        d_model=4096,
        ffn_hidden=14336,
        max_seq_len=8192,
        rope_theta=500000.0,
    ),
    "llama3-70b": LlamaConfig(
        vocab_size=128256,
        n_layer=80,
        n_head=64,
        n_kv_head=8,
        d_model=8192,
        ffn_hidden=28672,
        max_seq_len=8192,
        rope_theta=500000.0,
    ),
    "llama3-405b": LlamaConfig(
        vocab_size=128256,
        n_layer=126,
        n_head=128,
        n_kv_head=8,
        d_model=16384,
        ffn_hidden=53248,
        max_seq_len=8192,
        rope_theta=500000.0,
    ),
}


def get_config(name: str) -> ModelConfig:
    """The named config, or the shape in `hf:DIR` or a `.json` file of fields; an unknown name
    lists the known ones."""
    if name.startswith(HF_PREFIX) or name.endswith(".json"):
        return read_model_config(name)
    try:
        return MODEL_CONFIGS[name]
    except KeyError:
        known = ", ".join(MODEL_CONFIGS)
        raise ValueError(
            f"unknown model {name!r}: choose one of {known}, hf:DIR (a Hugging Face folder) or "
            "a JSON file of the model's fields (--model-config)"
        ) from None


def layer_specs(model: str | ModelConfig) -> list[LayerSpec]:
    """The layer list of a named model or a config."""
    config = get_config(model) if isinstance(model, str) else model
    return config.layer_specs()
