"""Hugging Face `config.json` both ways: ours for GPT-2, Llama, Mistral and Qwen2, and our
model config from theirs (read by `models.hf_config`, so `--model hf:DIR` resolves below the
checkpoint layer; its errors are raised here as `CheckpointError`).

Every field of theirs that changes what the model computes is either honoured or refused by
name, so an imported model never computes other logits than `transformers` does. Accepted
without a model field, and why:
- dropout rates (`resid_pdrop`, `embd_pdrop`, `attn_pdrop`, `attention_dropout`): they change
  nothing at inference, and meshpipe trains without dropout, as Llama-style pretraining does;
  refusing them would refuse GPT-2 itself (0.1). A fine-tune here is one without dropout.
- `reorder_and_upcast_attn` (GPT-2): the same attention, computed in fp32 by HF; in fp32 the
  logits are equal (tested), and in bf16 the attention kernels accumulate in fp32 too.
- `pretraining_tp` (Llama): HF 4 computed the same products in slices, HF 5 ignores it.
- Llama 3.1's rope scaling (`rope_type: llama3`, Llama 3.1 and 3.2): honoured
  (`LlamaConfig.rope_scaling`); the other rope types are refused.
- the layers of a Mistral or Qwen2 past their sliding window: honoured (`sliding_window`), so
  any sequence length computes what HF computes; only a Qwen2 mixing window and full layers is
  refused, as our blocks share one config.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from engine.checkpoint.files import CheckpointError
from models import GPTConfig, LlamaConfig, ModelConfig
from models.hf_config import LLAMA_FAMILIES, HFConfigError
from models.hf_config import model_config_from_hf as _from_hf

__all__ = [
    "DROPOUT_FIELDS",
    "LLAMA_FAMILIES",
    "dropout_note",
    "hf_config",
    "llama_family",
    "model_config_from_hf",
]

DROPOUT_FIELDS = ("resid_pdrop", "embd_pdrop", "attn_pdrop", "attention_dropout")
"""HF's dropout rates: read, not applied (see above); `dropout_note` says so."""


_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}

_NO_SPECIAL_TOKENS = {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
"""The byte tokenizer (`engine.data`) has no begin/end-of-text or padding token: its 256 ids
are the 256 byte values, and files are joined by a plain newline byte. Left out, HF would
fill in GPT-2's 50256 (outside our vocabulary) or Llama's 1 and 2 (real bytes, not markers).
A BPE tokenizer's end-of-text token is named by the exported `tokenizer_config.json`; the
model's config leaves it out too, so `transformers.generate` runs as long as `meshpipe
generate`, which does not stop at it."""


def _gpt2_config(config: GPTConfig) -> dict[str, Any]:
    if not config.bias:
        raise CheckpointError("HF GPT-2 has biases; a model with bias=False cannot export")
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": config.vocab_size,
        "n_positions": config.max_seq_len,
        "n_embd": config.d_model,
        "n_layer": config.n_layer,
        "n_head": config.n_head,
        "n_inner": config.ffn_hidden,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": config.norm_eps,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "tie_word_embeddings": config.tie_embeddings,
        "torch_dtype": "float32",
        **_NO_SPECIAL_TOKENS,
    }


def llama_family(config: LlamaConfig) -> str:
    """The HF architecture that holds `config`'s model: Qwen2 for biases on q, k, v only,
    Mistral for a window without biases, else Llama (or a CheckpointError naming the field)."""
    if config.qkv_bias and not (config.o_bias or config.mlp_bias):
        return "qwen2"
    if config.sliding_window is not None:
        if config.o_bias or config.mlp_bias:
            raise CheckpointError(
                f"sliding_window={config.sliding_window} with o_bias={config.o_bias}, "
                f"mlp_bias={config.mlp_bias}: no HF architecture has both (Mistral has no "
                "biases, Qwen2 only on q, k, v); this model cannot export"
            )
        return "mistral"
    if config.qkv_bias != config.o_bias:
        raise CheckpointError(
            f"o_bias={config.o_bias} with qkv_bias={config.qkv_bias}: HF Llama's "
            "attention_bias covers all four projections; this model cannot export"
        )
    return "llama"


def _family_fields(config: LlamaConfig, family: str) -> dict[str, Any]:
    window = config.sliding_window
    if family == "llama":
        return {"attention_bias": config.qkv_bias, "mlp_bias": config.mlp_bias}
    if family == "mistral":
        return {"sliding_window": window}
    return {  # qwen2: every layer from max_window_layers = 0 on slides when a window is set
        "use_sliding_window": window is not None,
        "sliding_window": window,
        "max_window_layers": 0 if window is not None else config.n_layer,
    }


def _rope_parameters(config: LlamaConfig) -> dict[str, Any]:
    if config.rope_scaling is None:
        return {"rope_type": "default", "rope_theta": config.rope_theta}
    factor, low, high, context = config.rope_scaling
    return {
        "rope_type": "llama3",
        "rope_theta": config.rope_theta,
        "factor": factor,
        "low_freq_factor": low,
        "high_freq_factor": high,
        "original_max_position_embeddings": context,
    }


def _llama_config(config: LlamaConfig) -> dict[str, Any]:
    family = llama_family(config)
    return {
        "architectures": [_ARCHITECTURES[family]],
        "model_type": family,
        "vocab_size": config.vocab_size,
        "hidden_size": config.d_model,
        "intermediate_size": config.ffn_hidden,
        "num_hidden_layers": config.n_layer,
        "num_attention_heads": config.n_head,
        "num_key_value_heads": config.n_kv_head,
        "head_dim": config.head_dim or config.d_model // config.n_head,
        "max_position_embeddings": config.max_seq_len,
        "rms_norm_eps": config.norm_eps,
        "rope_theta": config.rope_theta,
        "rope_parameters": _rope_parameters(config),
        "hidden_act": "silu",
        **_family_fields(config, family),
        "tie_word_embeddings": config.tie_embeddings,
        "torch_dtype": "float32",
        **_NO_SPECIAL_TOKENS,
    }


def hf_config(config: ModelConfig) -> dict[str, Any]:
    """`config.json` for HF's GPT2LMHeadModel, or LlamaForCausalLM, MistralForCausalLM or
    Qwen2ForCausalLM, whichever holds the model as it is."""
    if isinstance(config, GPTConfig):
        return _gpt2_config(config)
    return _llama_config(config)


def dropout_note(hf: Mapping[str, Any]) -> str | None:
    """What an import says of a `config.json`'s non-zero dropout rates, or None."""
    rates = {k: hf[k] for k in DROPOUT_FIELDS if isinstance(hf.get(k), int | float) and hf[k]}
    if not rates:
        return None
    listed = ", ".join(f"{k}={v}" for k, v in rates.items())
    return (
        f"note: {listed} not applied: the logits are the same (dropout is off at inference), "
        "but meshpipe trains without dropout, so a fine-tune here is one without it"
    )


def model_config_from_hf(hf: Mapping[str, Any], where: Path) -> ModelConfig:
    """Our config for an HF `config.json` (GPT-2, Llama, Mistral or Qwen2), or a
    CheckpointError saying why not (`models.hf_config` reads it)."""
    try:
        return _from_hf(hf, where)
    except HFConfigError as error:
        raise CheckpointError(str(error)) from None
