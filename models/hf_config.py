"""Our model config from a Hugging Face `config.json` (GPT-2, Llama, Mistral, Qwen2).

Every field of theirs that changes what the model computes is either honoured or refused by
name (`HFConfigError`), so an imported model never computes other logits than `transformers`
does; `engine.checkpoint.hf_configs` writes the other way and says which fields are accepted
without a model field, and why.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from models.gpt import GPTConfig
from models.layers import RopeScaling
from models.llama import LlamaConfig

__all__ = ["LLAMA_FAMILIES", "HFConfigError", "model_config_from_hf"]

LLAMA_FAMILIES = ("llama", "mistral", "qwen2")
"""The `model_type`s read as our Llama: one architecture with or without biases and window."""


class HFConfigError(ValueError):
    """A `config.json` describes a model meshpipe cannot build exactly."""


def _refuse_unless(ok: bool, where: Path, field: str, value: Any, why: str) -> None:
    if not ok:
        raise HFConfigError(
            f"{where}: {field}={value!r} {why}; meshpipe cannot represent this model, so it "
            "refuses it rather than compute other logits"
        )


def _gpt2_checks(hf: Mapping[str, Any]) -> list[tuple[str, Any, bool, str]]:
    """(field, its value, whether we compute it, why not) for GPT-2's fields off our model."""
    get = hf.get
    act, scaled = get("activation_function", "gelu_new"), get("scale_attn_weights", True)
    by_layer, cross = get("scale_attn_by_inverse_layer_idx", False), get("add_cross_attention")
    tanh = act in ("gelu_new", "gelu_pytorch_tanh")
    return [
        ("activation_function", act, tanh, "is not the tanh GELU"),
        ("scale_attn_weights", scaled, bool(scaled), "drops the 1/√head_dim scaling"),
        ("scale_attn_by_inverse_layer_idx", by_layer, not by_layer, "scales by 1/(layer+1)"),
        ("add_cross_attention", cross, not cross, "makes it the decoder of an encoder"),
    ]


def _gpt_from_hf(hf: Mapping[str, Any], where: Path) -> GPTConfig:
    d = int(hf["n_embd"])
    for field, value, ok, why in _gpt2_checks(hf):
        _refuse_unless(ok, where, field, value, why)
    inner = hf.get("n_inner")
    return GPTConfig(
        vocab_size=int(hf["vocab_size"]),
        n_layer=int(hf["n_layer"]),
        n_head=int(hf["n_head"]),
        d_model=d,
        max_seq_len=int(hf["n_positions"]),
        tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
        ffn_hidden=None if inner in (None, 4 * d) else int(inner),
        norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)),
    )


def _qwen2_window(hf: Mapping[str, Any], where: Path) -> int | None:
    """Qwen2's window: with `use_sliding_window`, on the layers `layer_types` marks (by
    default those from `max_window_layers` on); HF's defaults when left out: off, 4096, 28."""
    window = hf.get("sliding_window", 4096) if hf.get("use_sliding_window", False) else None
    if window is None:
        return None
    first, layers = int(hf.get("max_window_layers", 28)), int(hf["num_hidden_layers"])
    default = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
    kinds = sorted(set(hf.get("layer_types") or default))
    if kinds == ["full_attention"]:
        return None
    _refuse_unless(
        kinds == ["sliding_attention"], where, "use_sliding_window", True,
        f"with max_window_layers={first} of {layers} layers mixes windowed and full attention",
    )  # fmt: skip
    return int(window)


def _llama_extras(hf: Mapping[str, Any], where: Path, family: str) -> dict[str, Any]:
    """The fields of our LlamaConfig beyond the shape: biases and the attention window."""
    if family == "qwen2":
        return {"qkv_bias": True, "sliding_window": _qwen2_window(hf, where)}
    if family == "mistral":
        window = hf.get("sliding_window", 4096)
        return {"sliding_window": None if window is None else int(window)}
    attention_bias = bool(hf.get("attention_bias", False))
    return {
        "qkv_bias": attention_bias,
        "o_bias": attention_bias,
        "mlp_bias": bool(hf.get("mlp_bias", False)),
    }


def _rope(hf: Mapping[str, Any], where: Path) -> Mapping[str, Any]:
    """The rotary settings (`rope_parameters`, or `rope_scaling` before transformers 5):
    plain or Llama 3.1's, over the whole head."""
    field = "rope_parameters" if hf.get("rope_parameters") else "rope_scaling"
    rope = hf.get(field) or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    ours = kind in ("default", "llama3")
    _refuse_unless(ours, where, field, rope, "rescales positions other than Llama 3.1's way")
    partial = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    _refuse_unless(
        partial == 1.0, where, "partial_rotary_factor", partial, "rotates part of a head"
    )
    return dict(rope)


def _llama3_scaling(rope: Mapping[str, Any], context: int) -> RopeScaling | None:
    if rope.get("rope_type", rope.get("type")) != "llama3":
        return None
    original = rope.get("original_max_position_embeddings") or context
    return (rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"], original)


def _llama_from_hf(hf: Mapping[str, Any], where: Path, family: str) -> LlamaConfig:
    d, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    rope = _rope(hf, where)
    act = hf.get("hidden_act", "silu")
    _refuse_unless(act == "silu", where, "hidden_act", act, "is not SiLU")
    head_dim = hf.get("head_dim") or d // heads
    return LlamaConfig(
        vocab_size=int(hf["vocab_size"]),
        n_layer=int(hf["num_hidden_layers"]),
        n_head=heads,
        n_kv_head=int(hf.get("num_key_value_heads") or heads),
        d_model=d,
        ffn_hidden=int(hf["intermediate_size"]),
        max_seq_len=int(hf["max_position_embeddings"]),
        rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
        rope_scaling=_llama3_scaling(rope, int(hf["max_position_embeddings"])),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        head_dim=None if head_dim * heads == d else int(head_dim),
        **_llama_extras(hf, where, family),
    )


def model_config_from_hf(hf: Mapping[str, Any], where: Path) -> GPTConfig | LlamaConfig:
    """Our config for an HF `config.json` (GPT-2, Llama, Mistral or Qwen2), or a
    `HFConfigError` saying why not."""
    kind = hf.get("model_type")
    try:
        if kind == "gpt2":
            return _gpt_from_hf(hf, where)
        if kind in LLAMA_FAMILIES:
            return _llama_from_hf(hf, where, str(kind))
    except HFConfigError:
        raise
    except KeyError as missing:
        raise HFConfigError(f"{where} lacks {missing}") from None
    except (TypeError, ValueError, AttributeError) as error:  # a null, a string, a bad shape
        raise HFConfigError(
            f"{where} does not describe a model meshpipe can build ({error}): "
            "fix the file or re-export the model"
        ) from None
    raise HFConfigError(
        f"{where} has model_type {kind!r}; meshpipe reads 'gpt2', 'llama', 'mistral' and 'qwen2'"
    )
