"""Layer specs and the shared blocks of decoder LLMs.

A model is a *layer list*: an ordered list of `LayerSpec`s. A spec knows how to build one
`nn.Module` (on any device, `meta` included) and how to describe it, so partitioners and the
memory model can reason about a 70B model without allocating it, and every stage builds only
the layers it owns.
"""

from __future__ import annotations

import contextlib
import functools
import math
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal
from unittest import mock

import torch
import torch.nn.functional as F
from torch import nn

from models.documents import current_documents, document_mask, document_positions

__all__ = [
    "GELUMLP",
    "TIE_KEY",
    "CausalSelfAttention",
    "LayerSpec",
    "RopeScaling",
    "SwiGLUMLP",
    "apply_rotary",
    "block_flops",
    "init_layer",
    "param_seed",
    "rotary_embedding",
    "sliding_window_mask",
]

INIT_STD = 0.02

TIE_KEY = "token_embedding"
"""The tie group of a token embedding shared with the LM head (GPT-2, tied Llamas)."""


@dataclass(frozen=True, kw_only=True)
class LayerSpec:
    """How to build one layer of a layer list, and what it is.

    `module_cls(config)` builds the layer. `tie_key` names a weight shared with other layers
    (GPT-2's token embedding and LM head); `tied_param` is that weight's local name here.
    """

    name: str
    """Short role of the layer: `embedding`, `block`, `final_norm`, `lm_head`."""
    module_cls: type[nn.Module]
    """The layer's class; built as `module_cls(config)`."""
    config: Any
    """The model config the layer is built from (a frozen dataclass)."""
    input_kind: Literal["tokens", "hidden"] = "hidden"
    """What the layer consumes: token ids (B, T) or hidden states (B, T, d_model)."""
    tie_key: str | None = None
    """Key of the tie group this layer's `tied_param` belongs to, if any."""
    tied_param: str | None = None
    """Local name of the tied parameter (for example `wte.weight`)."""

    def __post_init__(self) -> None:
        if (self.tie_key is None) != (self.tied_param is None):
            raise ValueError(
                f"layer {self.name!r}: tie_key={self.tie_key!r} and tied_param="
                f"{self.tied_param!r} must be given together"
            )

    @property
    def kind(self) -> str:
        """The layer's class name (what DeepSpeed's `type:` partitioning matches)."""
        return self.module_cls.__name__

    def build(self, device: torch.device | str = "meta") -> nn.Module:
        """Build the layer's module with uninitialised storage on `device`."""
        with torch.device(device), _no_draws_on_meta(device):
            return self.module_cls(self.config)

    def num_parameters(self) -> int:
        """Parameter count, computed on the meta device (no memory)."""
        return _num_parameters(self)

    def forward_flops(self, batch_size: int, seq_len: int) -> int:
        """Analytic forward FLOPs for one (batch_size, seq_len) micro-batch."""
        return _forward_flops(self, batch_size, seq_len)

    def example_input(
        self, batch_size: int, seq_len: int, device: torch.device | str = "meta"
    ) -> torch.Tensor:
        """An input of the right shape and dtype, for profiling and tracing."""
        if self.input_kind == "tokens":
            return torch.zeros(batch_size, seq_len, dtype=torch.long, device=device)
        return torch.zeros(batch_size, seq_len, self.config.d_model, device=device)


def param_seed(seed: int, index: int | str, name: str) -> int:
    """Seed of one parameter: a function of (run seed, global layer index or tie key, name).

    Never of the partition, so every layout starts from the same weights.
    """
    key = f"{seed}/{index}/{name}".encode()
    return zlib.crc32(key) | (zlib.adler32(key) << 32)


def init_layer(
    module: nn.Module,
    spec: LayerSpec,
    *,
    seed: int,
    index: int,
    write: Callable[[nn.Parameter, torch.Tensor], None] | None = None,
) -> None:
    """Initialise a materialised layer in place, deterministically per parameter.

    Values are drawn on the CPU with a per-parameter generator and copied to the module's
    device, so CPU and CUDA builds start from identical weights. A tied parameter is seeded by
    its tie key instead of its layer index, so all copies of it are equal. `write` puts a
    parameter's drawn values (always its full shape) into it; by default a copy, for a sharded
    parameter the caller's cut of its own slice.
    """
    residual = set(getattr(module, "residual_params", ()))
    n_layer = int(spec.config.n_layer)
    for name, param in module.named_parameters():
        if name == spec.tied_param and spec.tie_key is not None:
            generator = torch.Generator().manual_seed(param_seed(seed, spec.tie_key, "tied"))
        else:
            generator = torch.Generator().manual_seed(param_seed(seed, index, name))
        values = torch.empty(param.shape, dtype=torch.float32)
        if param.dim() == 1:
            values.fill_(0.0 if name.endswith("bias") else 1.0)
        else:
            std = INIT_STD / math.sqrt(2 * n_layer) if name in residual else INIT_STD
            values.normal_(0.0, std, generator=generator)
        with torch.no_grad():
            if write is None:
                param.copy_(values)
            else:
                write(param, values)


def block_flops(
    module: nn.Module, width: int, batch_size: int, seq_len: int, window: int | None = None
) -> int:
    """Forward FLOPs of a transformer block: 2 per weight per token, plus causal attention.

    Causal attention does half of QK^T and AV: 2 * 2 * B * T^2 * d / 2, where d is the
    attention's width, n_head · head_dim (d_model unless a Llama sets its own head_dim). A
    sliding window w < T leaves T·w - w²/2 of the T²/2 query-key pairs.
    """
    tokens = batch_size * seq_len
    matmul = sum(p.numel() for p in module.parameters() if p.dim() == 2)
    pairs_twice = seq_len * seq_len
    if window is not None and window < seq_len:
        pairs_twice = 2 * seq_len * window - window * window
    attention = 2 * batch_size * pairs_twice * width
    return 2 * tokens * matmul + attention


RopeScaling = tuple[float, float, float, int]
"""Llama 3.1's rope scaling: (factor, low_freq_factor, high_freq_factor, the original context)."""


def _llama3_frequencies(inv_freq: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    """Wavelengths longer than context/low_freq_factor stretched by `factor`, those shorter
    than context/high_freq_factor kept, those between blended (Llama 3.1, as HF computes it)."""
    factor, low, high, context = scaling
    wavelength = 2 * math.pi / inv_freq
    stretched = torch.where(wavelength > context / low, inv_freq / factor, inv_freq)
    smooth = (context / wavelength - low) / (high - low)
    blended = (1 - smooth) * stretched / factor + smooth * stretched
    medium = (wavelength >= context / high) & (wavelength <= context / low)
    return torch.where(medium, blended, stretched)


def rotary_embedding(
    seq_len: int,
    head_dim: int,
    theta: float,
    device: torch.device,
    scaling: RopeScaling | None = None,
    positions: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables (seq_len, head_dim // 2) in fp32; cheap, so recomputed per call.
    With per-token `positions` (batch, seq_len) they are (batch, 1, seq_len, head_dim // 2)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim)
    if scaling is not None:
        inv_freq = _llama3_frequencies(inv_freq, scaling)
    if positions is not None:
        angles = (positions[:, None, :, None].float() * inv_freq).float()
        return angles.cos(), angles.sin()
    angles = torch.outer(torch.arange(seq_len, device=device).float(), inv_freq)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (B, H, T, hd) by position, with the half-split layout Hugging Face Llama uses."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return rotated.type_as(x)


class CausalSelfAttention(nn.Module):
    """Multi-head causal attention with grouped KV heads and optional rotary positions."""

    def __init__(
        self,
        d_model: int,
        n_head: int,
        n_kv_head: int,
        *,
        bias: bool,
        out_bias: bool | None = None,
        rope_theta: float | None = None,
        rope_scaling: RopeScaling | None = None,
        sliding_window: int | None = None,
        head_dim: int | None = None,
    ) -> None:
        """`bias` on the q, k, v projections and, unless `out_bias` says otherwise, on the
        output one (Qwen2 has the first three only); `sliding_window` lets a query see only
        itself and the `sliding_window - 1` positions before it (Mistral); `head_dim` defaults
        to d_model / n_head."""
        super().__init__()
        self.n_head, self.n_kv_head = n_head, n_kv_head
        self.head_dim = head_dim or d_model // n_head
        self.rope_theta, self.rope_scaling = rope_theta, rope_scaling
        self.sliding_window = sliding_window
        self.q_proj = nn.Linear(d_model, n_head * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(d_model, n_kv_head * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(d_model, n_kv_head * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(
            n_head * self.head_dim, d_model, bias=bias if out_bias is None else out_bias
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Head counts come from the projections' outputs, not from the config: under tensor
        parallelism each rank's q/k/v hold only its share of the heads."""
        batch, seq, _ = x.shape
        q = self.q_proj(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        documents = current_documents()
        if self.rope_theta is not None:
            positions = None if documents is None else document_positions(documents)
            cos, sin = rotary_embedding(
                seq, self.head_dim, self.rope_theta, x.device, self.rope_scaling, positions
            )
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        gqa = k.shape[1] != q.shape[1]
        window = self.sliding_window
        if documents is not None:  # packed documents: each attends only to itself
            mask = document_mask(documents, window)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        elif window is None or seq <= window:  # the window reaches back to the start
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        else:
            mask = sliding_window_mask(seq, window, x.device)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        return self.o_proj(y.transpose(1, 2).reshape(batch, seq, -1))


def sliding_window_mask(seq_len: int, window: int, device: torch.device) -> torch.Tensor:
    """(seq_len, seq_len) booleans: query i sees keys i - window < j <= i (Mistral's and
    Hugging Face's sliding window)."""
    positions = torch.arange(seq_len, device=device)
    back = positions[:, None] - positions[None, :]
    return (back >= 0) & (back < window)


class GELUMLP(nn.Module):
    """GPT-2's feed-forward: Linear, tanh-GELU, Linear."""

    def __init__(self, d_model: int, hidden: int, *, bias: bool) -> None:
        super().__init__()
        self.fc = nn.Linear(d_model, hidden, bias=bias)
        self.proj = nn.Linear(hidden, d_model, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class SwiGLUMLP(nn.Module):
    """Llama's feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, d_model: int, hidden: int, *, bias: bool = False) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(d_model, hidden, bias=bias)
        self.up_proj = nn.Linear(d_model, hidden, bias=bias)
        self.down_proj = nn.Linear(hidden, d_model, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


@contextlib.contextmanager
def _no_draws_on_meta(device: torch.device | str) -> Iterator[None]:
    """On `meta`, `nn.init.normal_` (an embedding's default init) does nothing: a meta tensor
    holds no values to draw. torch would run its Python decomposition of `normal_` there,
    whose first call imports `torch._dynamo` (with DTensor and sympy): 1.5 s of every process
    that builds a layer on meta, for a draw that is thrown away (`init_layer` draws the real
    values once the layer has storage)."""
    if torch.device(device).type != "meta":
        yield
        return
    with mock.patch.object(nn.init, "normal_", _unchanged):
        yield


def _unchanged(tensor: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
    return tensor


@functools.lru_cache(maxsize=4096)
def _num_parameters(spec: LayerSpec) -> int:
    """Once per distinct spec: the 126 blocks of a 405B model are one spec, and the planner
    asks for every layer's count per candidate split."""
    return sum(p.numel() for p in spec.build("meta").parameters())


@functools.lru_cache(maxsize=4096)
def _forward_flops(spec: LayerSpec, batch_size: int, seq_len: int) -> int:
    module: Any = spec.build("meta")
    return int(module.forward_flops(batch_size, seq_len))
