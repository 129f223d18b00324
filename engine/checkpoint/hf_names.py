"""Hugging Face names: our global names to and from those of `GPT2LMHeadModel` and
`LlamaForCausalLM` (Mistral and Qwen2 name their tensors as Llama does); the `config.json`
each side understands is `engine.checkpoint.hf_configs`'.

Each HF tensor is a *rule*: the concatenation of one or more of our tensors along dim 0,
transposed for GPT-2's Conv1D layers (`c_attn` is q, k, v stacked). Export applies the rules,
import inverts them, so a round trip is exact. Llama block names already follow HF's and our
rotary uses HF's half-split layout, so Llama needs renames only.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.checkpoint.files import canonical_name
from models import GPTConfig, LayerSpec, ModelConfig

__all__ = ["HFRule", "hf_rules"]


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
    """How every stored tensor of `config`'s model maps onto HF names (tied copies skipped:
    HF ties them again on load, from `tie_word_embeddings`)."""
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
