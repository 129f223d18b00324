"""Hugging Face names: our global names to and from `GPT2LMHeadModel` and
`LlamaForCausalLM` names, with a `config.json` each side understands.

Each HF tensor is a *rule*: the concatenation of one or more of our tensors along dim 0,
transposed for GPT-2's Conv1D layers (`c_attn` is q, k, v stacked). Export applies the rules,
import inverts them, so a round trip is exact. Llama block names already follow HF's and our
rotary uses HF's half-split layout, so Llama needs renames only.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.checkpoint.files import CheckpointError, canonical_name
from models import GPTConfig, LayerSpec, LlamaConfig, ModelConfig

__all__ = ["HFRule", "hf_config", "hf_rules", "model_config_from_hf"]


_GPT_BLOCK = {  # our local name -> (HF local name, transposed)
    "ln_1.weight": ("ln_1.weight", False),
    "ln_1.bias": ("ln_1.bias", False),
    "attn.q_proj.weight": ("attn.c_attn.weight", True),
    "attn.k_proj.weight": ("attn.c_attn.weight", True),
    "attn.v_proj.weight": ("attn.c_attn.weight", True),
    "attn.q_proj.bias": ("attn.c_attn.bias", False),
    "attn.k_proj.bias": ("attn.c_attn.bias", False),
    "attn.v_proj.bias": ("attn.c_attn.bias", False),
    "attn.o_proj.weight": ("attn.c_proj.weight", True),
    "attn.o_proj.bias": ("attn.c_proj.bias", False),
    "ln_2.weight": ("ln_2.weight", False),
    "ln_2.bias": ("ln_2.bias", False),
    "mlp.fc.weight": ("mlp.c_fc.weight", True),
    "mlp.fc.bias": ("mlp.c_fc.bias", False),
    "mlp.proj.weight": ("mlp.c_proj.weight", True),
    "mlp.proj.bias": ("mlp.c_proj.bias", False),
}


@dataclass(frozen=True, kw_only=True)
class HFRule:
    hf: str
    """The HF tensor's name."""
    ours: tuple[str, ...]
    """Our stored names, concatenated along dim 0 in this order."""
    transpose: bool
    """GPT-2's Conv1D stores (in, out): transpose after concatenating."""


def _hf_name(config: ModelConfig, spec: LayerSpec, block: int, local: str) -> tuple[str, bool]:
    gpt = isinstance(config, GPTConfig)
    if spec.name == "block":
        name, transpose = _GPT_BLOCK[local] if gpt else (local, False)
        return (f"transformer.h.{block}." if gpt else f"model.layers.{block}.") + name, transpose
    if spec.name == "lm_head":
        return "lm_head.weight", False
    return ("transformer." if gpt else "model.") + local, False


def hf_rules(config: ModelConfig) -> list[HFRule]:
    """How every stored tensor of `config`'s model maps onto HF names (tied copies skipped)."""
    specs = config.layer_specs()
    groups: dict[str, tuple[list[str], bool]] = {}
    for i, spec in enumerate(specs):
        for local, _ in spec.build("meta").named_parameters():
            ours = f"layers.{i}.{local}"
            if canonical_name(specs, ours) != ours:
                continue
            hf, transpose = _hf_name(config, spec, i - 1, local)
            groups.setdefault(hf, ([], transpose))[0].append(ours)
    return [HFRule(hf=k, ours=tuple(v), transpose=t) for k, (v, t) in groups.items()]


_NO_SPECIAL_TOKENS = {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
"""The byte tokenizer (`engine.data`) has no begin/end-of-text or padding token: its 256 ids
are the 256 byte values, and files are joined by a plain newline byte. Left out, HF would
fill in GPT-2's 50256 (outside our vocabulary) or Llama's 1 and 2 (real bytes, not markers)."""


def hf_config(config: ModelConfig) -> dict[str, Any]:
    """`config.json` for HF's `GPT2LMHeadModel` or `LlamaForCausalLM`."""
    if isinstance(config, GPTConfig):
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
            "n_inner": None,
            "activation_function": "gelu_new",
            "layer_norm_epsilon": 1e-5,
            "resid_pdrop": 0.0,
            "embd_pdrop": 0.0,
            "attn_pdrop": 0.0,
            "tie_word_embeddings": config.tie_embeddings,
            "torch_dtype": "float32",
            **_NO_SPECIAL_TOKENS,
        }
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": config.vocab_size,
        "hidden_size": config.d_model,
        "intermediate_size": config.ffn_hidden,
        "num_hidden_layers": config.n_layer,
        "num_attention_heads": config.n_head,
        "num_key_value_heads": config.n_kv_head,
        "head_dim": config.d_model // config.n_head,
        "max_position_embeddings": config.max_seq_len,
        "rms_norm_eps": config.norm_eps,
        "rope_theta": config.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        **_NO_SPECIAL_TOKENS,
    }


def _require(ok: bool, where: Path, what: str) -> None:
    if not ok:
        raise CheckpointError(f"{where}: {what}; meshpipe cannot represent this model")


def _gpt_from_hf(hf: Mapping[str, Any], where: Path) -> GPTConfig:
    d = int(hf["n_embd"])
    _require(hf.get("n_inner") in (None, 4 * d), where, f"n_inner={hf.get('n_inner')} != 4·n_embd")
    act = hf.get("activation_function", "gelu_new")
    tanh = act in ("gelu_new", "gelu_pytorch_tanh")
    _require(tanh, where, f"activation {act!r} is not tanh-GELU")
    eps = hf.get("layer_norm_epsilon", 1e-5)
    _require(eps == 1e-5, where, f"layer_norm_epsilon={eps}, ours is 1e-5")
    return GPTConfig(
        vocab_size=int(hf["vocab_size"]),
        n_layer=int(hf["n_layer"]),
        n_head=int(hf["n_head"]),
        d_model=d,
        max_seq_len=int(hf["n_positions"]),
        tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
    )


def _llama_from_hf(hf: Mapping[str, Any], where: Path) -> LlamaConfig:
    d, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    _require(rope.get("rope_type", "default") == "default", where, f"rope scaling {rope}")
    _require(hf.get("hidden_act", "silu") == "silu", where, f"hidden_act={hf.get('hidden_act')}")
    _require(not hf.get("attention_bias") and not hf.get("mlp_bias"), where, "it has biases")
    _require(hf.get("head_dim", d // heads) == d // heads, where, "head_dim != hidden/heads")
    return LlamaConfig(
        vocab_size=int(hf["vocab_size"]),
        n_layer=int(hf["num_hidden_layers"]),
        n_head=heads,
        n_kv_head=int(hf.get("num_key_value_heads", heads)),
        d_model=d,
        ffn_hidden=int(hf["intermediate_size"]),
        max_seq_len=int(hf["max_position_embeddings"]),
        rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
    )


def model_config_from_hf(hf: Mapping[str, Any], where: Path) -> ModelConfig:
    """Our config for an HF `config.json` (GPT-2 or Llama), or a CheckpointError saying why not."""
    kind = hf.get("model_type")
    try:
        if kind == "gpt2":
            return _gpt_from_hf(hf, where)
        if kind == "llama":
            return _llama_from_hf(hf, where)
    except CheckpointError:
        raise
    except KeyError as missing:
        raise CheckpointError(f"{where} lacks {missing}") from None
    except (TypeError, ValueError, AttributeError) as error:  # a null, a string, a bad shape
        raise CheckpointError(
            f"{where} does not describe a model meshpipe can build ({error}): "
            "fix the file or re-export the model"
        ) from None
    raise CheckpointError(f"{where} has model_type {kind!r}; meshpipe reads 'gpt2' and 'llama'")
