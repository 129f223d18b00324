"""Llama style decoder as a layer list.

Layers: token embedding, `n_layer` blocks (RMSNorm, rotary grouped-query attention, RMSNorm,
SwiGLU MLP), final RMSNorm, LM head (untied unless `tie_embeddings`). The fields past the
shape cover the Llama-architecture families on the Hub: biases (Qwen2's on q, k, v), a sliding
attention window (Mistral), tied embeddings (small Llamas). Parameter names follow Hugging Face's
`LlamaForCausalLM` inside each block so that export is a rename of the prefix only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from models.layers import (
    TIE_KEY,
    CausalSelfAttention,
    LayerSpec,
    RopeScaling,
    SwiGLUMLP,
    block_flops,
)

__all__ = [
    "LlamaBlock",
    "LlamaConfig",
    "LlamaEmbedding",
    "LlamaFinalNorm",
    "LlamaHead",
    "llama_layers",
]


@dataclass(frozen=True, kw_only=True)
class LlamaConfig:
    """Shape of a Llama style model."""

    vocab_size: int
    """Number of token ids."""
    n_layer: int
    """Number of transformer blocks."""
    n_head: int
    """Query heads per block."""
    n_kv_head: int
    """Key/value heads per block (grouped-query attention when < n_head)."""
    d_model: int
    """Hidden size."""
    ffn_hidden: int
    """Inner size of the SwiGLU MLP."""
    max_seq_len: int
    """Longest sequence the model is meant for (rotary positions work beyond it)."""
    rope_theta: float = 10000.0
    """Base of the rotary frequencies."""
    rope_scaling: RopeScaling | None = None
    """Llama 3.1's rope scaling (factor, low_freq_factor, high_freq_factor, original context
    length); None leaves the frequencies as `rope_theta` gives them."""
    norm_eps: float = 1e-5
    """Epsilon of RMSNorm."""
    qkv_bias: bool = False
    """Biases on the q, k and v projections (Qwen2; Llama's `attention_bias`)."""
    o_bias: bool = False
    """A bias on the attention's output projection (Llama's `attention_bias`)."""
    mlp_bias: bool = False
    """Biases on the three MLP projections (Llama's `mlp_bias`)."""
    sliding_window: int | None = None
    """Each position attends to itself and the `sliding_window - 1` before it (Mistral);
    None attends to every earlier position."""
    tie_embeddings: bool = False
    """Share the LM head's weight with the token embedding."""
    head_dim: int | None = None
    """Width of each attention head; None: d_model / n_head (Qwen3 and Mistral Nemo differ)."""

    def __post_init__(self) -> None:
        if (self.head_dim is None and self.d_model % self.n_head) or self.n_head % self.n_kv_head:
            raise ValueError(
                f"d_model={self.d_model}, n_head={self.n_head}, n_kv_head={self.n_kv_head}: "
                "d_model must be a multiple of n_head (or head_dim given) and n_head a "
                "multiple of n_kv_head"
            )
        if self.head_dim is not None and (self.head_dim < 2 or self.head_dim % 2):
            raise ValueError(
                f"head_dim={self.head_dim}: rotary positions rotate pairs of channels, so give "
                "an even head_dim of at least 2, or None for d_model / n_head"
            )
        if self.rope_scaling is not None:  # a list once read back from JSON
            object.__setattr__(self, "rope_scaling", _rope_scaling(self.rope_scaling))
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(
                f"sliding_window={self.sliding_window} leaves no position to attend to: give "
                "a window of at least 1, or None for full causal attention"
            )

    def layer_specs(self) -> list[LayerSpec]:
        return llama_layers(self)


def _rope_scaling(value: Sequence[float]) -> RopeScaling:
    factor, low, high, context = value
    if not (factor >= 1 and 0 < low < high and context >= 1):
        raise ValueError(
            f"rope_scaling={tuple(value)} is not Llama 3.1's (factor >= 1, 0 < low_freq_factor "
            "< high_freq_factor, original context >= 1): e.g. (8.0, 1.0, 4.0, 8192)"
        )
    return float(factor), float(low), float(high), int(context)


class LlamaEmbedding(nn.Module):
    """Token embedding (positions enter through rotary attention)."""

    residual_params: tuple[str, ...] = ()
    tp_plan: ClassVar[dict[str, str]] = {"embed_tokens": "vocab_embedding"}
    sp_plan: ClassVar[dict[str, str]] = {}  # the vocabulary split reduce-scatters the sequence

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.max_seq_len = config.max_seq_len
        self.embed_tokens = nn.Embedding(config.vocab_size, config.d_model)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if tokens.shape[1] > self.max_seq_len:
            raise ValueError(
                f"sequence length {tokens.shape[1]} exceeds the model's context "
                f"{self.max_seq_len}: use a shorter --seq-len"
            )
        return self.embed_tokens(tokens)

    def forward_flops(self, batch_size: int, seq_len: int) -> int:
        return batch_size * seq_len * self.embed_tokens.embedding_dim


class LlamaBlock(nn.Module):
    """x + attn(rmsnorm(x)), then x + mlp(rmsnorm(x))."""

    residual_params: tuple[str, ...] = ("self_attn.o_proj.weight", "mlp.down_proj.weight")
    tp_plan: ClassVar[dict[str, str]] = {
        "self_attn": "shared_input",
        "self_attn.q_proj": "colwise",
        "self_attn.k_proj": "colwise",
        "self_attn.v_proj": "colwise",
        "self_attn.o_proj": "rowwise",
        "mlp": "shared_input",
        "mlp.gate_proj": "colwise",
        "mlp.up_proj": "colwise",
        "mlp.down_proj": "rowwise",
    }
    sp_plan: ClassVar[dict[str, str]] = {  # attention gathers the sequence: global rotary positions
        "input_layernorm": "sequence_norm",
        "self_attn": "sequence_gather",
        "post_attention_layernorm": "sequence_norm",
        "mlp": "sequence_gather",
    }

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.d_model = config.d_model
        self.input_layernorm = nn.RMSNorm(config.d_model, eps=config.norm_eps)
        self.self_attn = CausalSelfAttention(
            config.d_model,
            config.n_head,
            config.n_kv_head,
            bias=config.qkv_bias,
            out_bias=config.o_bias,
            rope_theta=config.rope_theta,
            rope_scaling=config.rope_scaling,
            sliding_window=config.sliding_window,
            head_dim=config.head_dim,
        )
        self.post_attention_layernorm = nn.RMSNorm(config.d_model, eps=config.norm_eps)
        self.mlp = SwiGLUMLP(config.d_model, config.ffn_hidden, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_flops(self, batch_size: int, seq_len: int) -> int:
        attn = self.self_attn
        width = attn.n_head * attn.head_dim
        return block_flops(self, width, batch_size, seq_len, attn.sliding_window)


class LlamaFinalNorm(nn.Module):
    """The RMSNorm after the last block."""

    residual_params: tuple[str, ...] = ()
    sp_plan: ClassVar[dict[str, str]] = {"norm": "sequence_norm"}

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(config.d_model, eps=config.norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x)

    def forward_flops(self, batch_size: int, seq_len: int) -> int:
        return 4 * batch_size * seq_len * self.norm.weight.numel()


class LlamaHead(nn.Module):
    """Projection onto the vocabulary (tied to the token embedding if `tie_embeddings`)."""

    residual_params: tuple[str, ...] = ()
    tp_plan: ClassVar[dict[str, str]] = {"lm_head": "vocab_head"}
    sp_plan: ClassVar[dict[str, str]] = {}

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(x)

    def forward_flops(self, batch_size: int, seq_len: int) -> int:
        return 2 * batch_size * seq_len * self.lm_head.weight.numel()


def llama_layers(config: LlamaConfig) -> list[LayerSpec]:
    """The layer list: embedding, blocks, final norm, head."""
    tie_key = TIE_KEY if config.tie_embeddings else None
    return [
        LayerSpec(
            name="embedding",
            module_cls=LlamaEmbedding,
            config=config,
            input_kind="tokens",
            tie_key=tie_key,
            tied_param="embed_tokens.weight" if tie_key else None,
        ),
        *(
            LayerSpec(name="block", module_cls=LlamaBlock, config=config)
            for _ in range(config.n_layer)
        ),
        LayerSpec(name="final_norm", module_cls=LlamaFinalNorm, config=config),
        LayerSpec(
            name="lm_head",
            module_cls=LlamaHead,
            config=config,
            tie_key=tie_key,
            tied_param="lm_head.weight" if tie_key else None,
        ),
    ]
