"""GPT-2 style decoder as a layer list.

Layers: token + learned position embedding, `n_layer` pre-LN blocks, final LayerNorm, LM head
(optionally tied to the token embedding through the tie key `token_embedding`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from models.documents import current_documents, document_positions
from models.layers import GELUMLP, TIE_KEY, CausalSelfAttention, LayerSpec, block_flops

__all__ = ["GPTBlock", "GPTConfig", "GPTEmbedding", "GPTFinalNorm", "GPTHead", "gpt_layers"]


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """Shape of a GPT-2 style model."""

    vocab_size: int
    """Number of token ids."""
    n_layer: int
    """Number of transformer blocks."""
    n_head: int
    """Attention heads per block."""
    d_model: int
    """Hidden size."""
    max_seq_len: int
    """Context length (rows of the learned position embedding)."""
    bias: bool = True
    """Biases in Linear and LayerNorm layers, as GPT-2 has."""
    tie_embeddings: bool = True
    """Share the LM head's weight with the token embedding."""
    ffn_hidden: int | None = None
    """Inner size of the MLP; None: 4 · d_model, as GPT-2 (HF's `n_inner`)."""
    norm_eps: float = 1e-5
    """Epsilon of the LayerNorms (HF's `layer_norm_epsilon`)."""

    def __post_init__(self) -> None:
        if self.d_model % self.n_head:
            raise ValueError(
                f"d_model={self.d_model} is not divisible by n_head={self.n_head}: "
                "choose d_model as a multiple of n_head"
            )

    def layer_specs(self) -> list[LayerSpec]:
        return gpt_layers(self)


class GPTEmbedding(nn.Module):
    """Token plus learned position embedding."""

    residual_params: tuple[str, ...] = ()
    tp_plan: ClassVar[dict[str, str]] = {"wte": "vocab_embedding"}
    """How tensor parallelism splits the layer: submodule → role (`colwise`, `rowwise`,
    `vocab_embedding`, `vocab_head`; "" is the layer itself); the rest stays replicated."""
    sp_plan: ClassVar[dict[str, str]] = {"wpe": "sequence_positions"}
    """What the replicated modules do under sequence parallelism, where the layer's output is
    each tp rank's 1/tp of the sequence (`sequence_norm`, `sequence_gather`,
    `sequence_positions`): the position table looks up the shard's global positions."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.max_seq_len = config.max_seq_len
        self.wte = nn.Embedding(config.vocab_size, config.d_model)
        self.wpe = nn.Embedding(config.max_seq_len, config.d_model)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        seq_len = tokens.shape[1]
        if seq_len > self.max_seq_len:
            raise ValueError(
                f"sequence length {seq_len} exceeds the model's context {self.max_seq_len}: "
                "use a shorter --seq-len or a model with a longer max_seq_len"
            )
        documents = current_documents()
        if documents is None:
            positions = torch.arange(seq_len, device=tokens.device)
        else:  # packed documents: each counts its positions from 0
            positions = document_positions(documents)
        return self.wte(tokens) + self.wpe(positions)

    def forward_flops(self, batch_size: int, seq_len: int) -> int:
        return batch_size * seq_len * self.wte.embedding_dim


class GPTBlock(nn.Module):
    """Pre-LN transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    residual_params: tuple[str, ...] = ("attn.o_proj.weight", "mlp.proj.weight")
    tp_plan: ClassVar[dict[str, str]] = {
        "attn": "shared_input",
        "attn.q_proj": "colwise",
        "attn.k_proj": "colwise",
        "attn.v_proj": "colwise",
        "attn.o_proj": "rowwise",
        "mlp.fc": "colwise",
        "mlp.proj": "rowwise",
    }
    sp_plan: ClassVar[dict[str, str]] = {
        "ln_1": "sequence_norm",
        "attn": "sequence_gather",
        "ln_2": "sequence_norm",
        "mlp": "sequence_gather",
    }

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.d_model = config.d_model
        self.ln_1 = nn.LayerNorm(config.d_model, eps=config.norm_eps, bias=config.bias)
        self.attn = CausalSelfAttention(
            config.d_model, config.n_head, config.n_head, bias=config.bias
        )
        self.ln_2 = nn.LayerNorm(config.d_model, eps=config.norm_eps, bias=config.bias)
        hidden = config.ffn_hidden or 4 * config.d_model
        self.mlp = GELUMLP(config.d_model, hidden, bias=config.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))

    def forward_flops(self, batch_size: int, seq_len: int) -> int:
        return block_flops(self, self.d_model, batch_size, seq_len)


class GPTFinalNorm(nn.Module):
    """The LayerNorm after the last block."""

    residual_params: tuple[str, ...] = ()
    sp_plan: ClassVar[dict[str, str]] = {"ln_f": "sequence_norm"}

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_f = nn.LayerNorm(config.d_model, eps=config.norm_eps, bias=config.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ln_f(x)

    def forward_flops(self, batch_size: int, seq_len: int) -> int:
        return 5 * batch_size * seq_len * self.ln_f.normalized_shape[0]


class GPTHead(nn.Linear):
    """Projection of hidden states onto the vocabulary (logits): a Linear without bias.

    A Linear so that engines treat its weight gradient as the GEMM it is (the split backward
    defers it to W); the weight is drawn by `init_layer`, not by `reset_parameters`.
    """

    residual_params: tuple[str, ...] = ()
    tp_plan: ClassVar[dict[str, str]] = {"": "vocab_head"}
    sp_plan: ClassVar[dict[str, str]] = {}  # vocab_head gathers the sequence itself

    def __init__(self, config: GPTConfig) -> None:
        super().__init__(config.d_model, config.vocab_size, bias=False)

    def reset_parameters(self) -> None:
        """No draw here: `init_layer` initialises every layer per (seed, layer index)."""

    def forward_flops(self, batch_size: int, seq_len: int) -> int:
        return 2 * batch_size * seq_len * self.weight.numel()


def gpt_layers(config: GPTConfig) -> list[LayerSpec]:
    """The layer list: embedding, blocks, final norm, head."""
    tie_key = TIE_KEY if config.tie_embeddings else None
    embedding = LayerSpec(
        name="embedding",
        module_cls=GPTEmbedding,
        config=config,
        input_kind="tokens",
        tie_key=tie_key,
        tied_param="wte.weight" if tie_key else None,
    )
    blocks = [
        LayerSpec(name="block", module_cls=GPTBlock, config=config) for _ in range(config.n_layer)
    ]
    final_norm = LayerSpec(name="final_norm", module_cls=GPTFinalNorm, config=config)
    head = LayerSpec(
        name="lm_head",
        module_cls=GPTHead,
        config=config,
        tie_key=tie_key,
        tied_param="weight" if tie_key else None,
    )
    return [embedding, *blocks, final_norm, head]
