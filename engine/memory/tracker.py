"""What a device holds: live bytes of tensor storages, on fake or real tensors alike.

`MemoryTracker` is the one instrument of the memory model. It counts the storages that ops create
while it is active until they are freed, so the same code measures a replay on `FakeTensorMode`
tensors (no memory, any model size) and on real CPU or CUDA tensors (`meshpipe memory --measure`).
`cuda_kernels` stands in for the fused CUDA kernels a CPU trace would not run (flash attention,
fused RMSNorm), allocating exactly what they allocate; see docs/MEMORY.md for what is modelled.
"""

from __future__ import annotations

import contextlib
import contextvars
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any
from unittest import mock

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass

__all__ = ["CUDA_BLOCK", "MemoryTracker", "Span", "cuda_kernels", "fake_device", "round_up"]

_LOW = (torch.float16, torch.bfloat16)
_LAYER_NORM = torch.ops.aten.native_layer_norm.default
_TO_COPY = torch.ops.aten._to_copy.default

CUDA_BLOCK = 512
"""The CUDA caching allocator rounds every allocation up to a multiple of 512 bytes."""


def round_up(nbytes: int, block: int) -> int:
    """`nbytes` rounded up to a whole number of `block`-byte blocks (0 stays 0)."""
    return -(-nbytes // block) * block


@dataclass(frozen=True, slots=True)
class Span:
    """What one stretch of work did to the live bytes: its highest point and where it ended,
    both relative to the live bytes when it started."""

    peak: int
    net: int


def _tensors(tree: Any) -> list[torch.Tensor]:
    """The tensors of `tree` (an op's arguments or outputs: tensors in tuples, lists and dicts)
    that hold memory. A wrapper subclass (DTensor, a functional collective's
    AsyncCollectiveTensor) stands for the tensors inside it: its own storage is as large as
    the whole (global) tensor and allocates nothing.

    A plain walk rather than `tree_flatten`: it runs twice per op of every trace, and traces
    ran 15-35 % longer with pytree's general flattening."""
    found: list[torch.Tensor] = []
    pending = [tree]
    while pending:
        item = pending.pop()
        if isinstance(item, torch.Tensor):
            if is_traceable_wrapper_subclass(item):
                names, _ = item.__tensor_flatten__()
                pending += [getattr(item, name) for name in names]
            else:
                found.append(item)
        elif isinstance(item, (tuple, list)):
            pending += item
        elif isinstance(item, dict):
            pending += item.values()
    return found


def _casts_a_weight(func: Any, args: tuple[Any, ...]) -> bool:
    """Whether an op's output is a parameter cast to another dtype (what autocast saves)."""
    return func is _TO_COPY and bool(args) and isinstance(args[0], nn.Parameter)


class MemoryTracker(TorchDispatchMode):
    """Bytes of the storages that ops create while the tracker is active and that are alive.

    A storage counts from the op that creates it until it is freed (a weak reference to the
    storage reports it), rounded up to `block` bytes (512 models the CUDA caching allocator).
    Views and in-place results share a storage that already counts or that the op read, so
    nothing counts twice and tensors made before the tracker (parameters, optimizer states)
    never count. Only op outputs are seen: a kernel's internal workspace is not.
    """

    def __init__(self, *, block: int = 1) -> None:
        super().__init__()
        if block < 1:
            raise ValueError(f"block={block} must be at least 1 byte")
        self.block = block
        self.live = 0
        """Bytes alive now."""
        self.peak = 0
        """Most bytes alive at once since the tracker was made."""
        self.weight_copies = 0
        """Of `live`: copies of parameters in another dtype (what autocast casts and saves)."""
        self._window_peak = 0
        self._alive: dict[int, weakref.ref[torch.UntypedStorage]] = {}
        self._sizes: dict[int, int] = {}

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        if func is _LAYER_NORM:
            out = _device_layer_norm(args, out)
        read: set[int] | None = None
        for tensor in _tensors(out):
            storage = tensor.untyped_storage()
            if storage._cdata in self._alive:
                continue  # a view or in-place result of a storage already counted
            if read is None:  # only now: most ops make no new storage, or none at all
                read = {t.untyped_storage()._cdata for t in _tensors((args, kwargs))}
            if storage._cdata not in read:
                self._count(storage, weight_copy=_casts_a_weight(func, args))
        return out

    def measure(self, work: Callable[[], object]) -> Span:
        """Run `work` and return its peak and net change of the live bytes."""
        start = self._window_peak = self.live
        work()
        return Span(peak=self._window_peak - start, net=self.live - start)

    def _count(self, storage: torch.UntypedStorage, *, weight_copy: bool) -> None:
        key = storage._cdata
        if key in self._alive:
            return
        nbytes = round_up(storage.nbytes(), self.block)
        self._alive[key] = weakref.ref(storage, lambda _: self._free(key, weight_copy))
        self._sizes[key] = nbytes
        self._add(nbytes, weight_copy)

    def resized(self, storage: torch.UntypedStorage, nbytes: int) -> None:
        """A counted storage resized in place to `nbytes` (FSDP2 frees and reallocates its
        gathered parameters so, outside the dispatcher: `rank_states.fsdp_resizes`)."""
        key = storage._cdata
        if key in self._alive:
            new = round_up(nbytes, self.block)
            self._add(new - self._sizes[key], weight_copy=False)
            self._sizes[key] = new

    def _add(self, nbytes: int, weight_copy: bool) -> None:
        self.live += nbytes
        self.weight_copies += nbytes if weight_copy else 0
        self.peak = max(self.peak, self.live)
        self._window_peak = max(self._window_peak, self.live)

    def _free(self, key: int, weight_copy: bool) -> None:
        if self._alive.pop(key, None) is not None:
            nbytes = self._sizes.pop(key)
            self.live -= nbytes
            self.weight_copies -= nbytes if weight_copy else 0


class _FlashAttention(torch.autograd.Function):
    """Allocations of FlashAttention-2 as torch vendors it (`mha_fwd`, `mha_bwd`).

    Forward: the output in (B, T, H, d) layout, the fp32 log-sum-exp (B, H, T) and two small
    RNG-state tensors, all kept for backward with q, k, v. Backward: dq, dk, dv, the fp32
    `softmax_d` (B, H, T↑128) and `dq_accum` (B, T↑128, H, d↑32), and with grouped KV heads dk
    and dv expanded to all query heads before they are summed.
    """

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        b, h, t, _ = q.shape
        out = q.new_empty(b, t, h, v.shape[-1]).transpose(1, 2)
        lse = q.new_empty(b, h, t, dtype=torch.float32)
        rng_state = q.new_empty(2, dtype=torch.uint64)
        unused = q.new_empty((), dtype=torch.uint64)
        ctx.save_for_backward(q, k, v, out, lse, rng_state, unused)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor, ...]:
        q, k, v = ctx.saved_tensors[:3]
        b, h, t, d = q.shape
        heads_kv, t_kv = k.shape[1], k.shape[2]
        dq = q.new_empty(b, t, h, d)
        dk = k.new_empty(b, t_kv, heads_kv, d)
        dv = v.new_empty(b, t_kv, heads_kv, v.shape[-1])
        t_rounded, d_rounded = round_up(t, 128), round_up(d, 32 if d <= 128 else 64)
        workspace = [
            q.new_empty(b, h, t_rounded, dtype=torch.float32),
            q.new_empty(b, t_rounded, h, d_rounded, dtype=torch.float32),
        ]
        if heads_kv != h:
            workspace += [q.new_empty(b, t_kv, h, d), q.new_empty(b, t_kv, h, v.shape[-1])]
        del workspace
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


class _FusedRMSNorm(torch.autograd.Function):
    """Allocations of `aten._fused_rms_norm` on CUDA: the output and fp32 rstd per row, kept
    with the input for backward, which allocates the input and weight gradients."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None, dims: int) -> torch.Tensor:
        rstd = x.new_empty(*x.shape[: x.dim() - dims], *([1] * dims), dtype=torch.float32)
        ctx.save_for_backward(x, rstd, weight)
        return torch.empty_like(x)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, _, weight = ctx.saved_tensors
        grad_weight = torch.empty_like(weight) if ctx.needs_input_grad[1] else None
        return torch.empty_like(x), grad_weight, None


_SDPA = F.scaled_dot_product_attention
_RMS_NORM = F.rms_norm


def _attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """Flash attention where CUDA picks it: fp16/bf16, no mask, no dropout, head dim % 8.

    fp32 falls through to the CPU kernel: CUDA runs the memory-efficient or math kernel there,
    which this model does not reproduce (docs/MEMORY.md).
    """
    if q.dtype in _LOW and attn_mask is None and dropout_p == 0.0 and q.shape[-1] % 8 == 0:
        out: torch.Tensor = _FlashAttention.apply(q, k, v)
        return out
    return _SDPA(q, k, v, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)


def _rms_norm(
    x: torch.Tensor,
    normalized_shape: list[int] | tuple[int, ...],
    weight: torch.Tensor | None = None,
    eps: float | None = None,
) -> torch.Tensor:
    """The fused kernel where CUDA takes it: input and weight dtypes agree (autocast's bf16
    input with an fp32 weight falls back to the composite, on CUDA as on the CPU)."""
    if weight is not None and weight.dtype != x.dtype:
        return _RMS_NORM(x, normalized_shape, weight, eps)
    out: torch.Tensor = _FusedRMSNorm.apply(x, weight, len(normalized_shape))
    return out


@contextlib.contextmanager
def cuda_kernels() -> Iterator[None]:
    """Route a CPU trace through what CUDA runs: flash attention instead of the CPU kernels,
    the fused RMSNorm instead of the composite that saves fp32 copies.

    The functions are swapped in `torch.nn.functional` rather than caught by a
    `TorchFunctionMode`, which is not active when activation checkpointing recomputes a
    forward inside the backward.
    """
    with (
        mock.patch.object(F, "scaled_dot_product_attention", _attention),
        mock.patch.object(F, "rms_norm", _rms_norm),
    ):
        yield


_FAKE_CUDA: contextvars.ContextVar[bool | None] = contextvars.ContextVar("fake_cuda", default=None)
"""Inside `fake_device`: whether the fake device is CUDA (else CPU); None outside it."""


def _device_layer_norm(args: tuple[Any, ...], out: Any) -> Any:
    """A fake layer norm's outputs as the modelled device's kernel makes them, where the meta
    kernel's differ: it keeps its per-row mean and rstd in fp32 for fp16/bf16 input (the CPU
    kernel too when the weight is fp32, as it is under autocast), not in the input's dtype.

    Applied by the tracker rather than by a dispatch mode of its own: each mode on the stack
    costs every op a Python call, the fake tensors' `prim.device` queries (half a trace's
    ops) too: llama3-405b's 20 block traces took 5.95 s with one, 4.31 s without."""
    cuda = _FAKE_CUDA.get()
    if cuda is not None and out[1].dtype in _LOW:
        weight = args[2] if len(args) > 2 else None
        if cuda or (weight is not None and weight.dtype == torch.float32):
            return out[0], out[1].float(), out[2].float()
    return out


@contextlib.contextmanager
def fake_device(*, cuda: bool) -> Iterator[FakeTensorMode]:
    """Fake tensors that allocate as the modelled device does (enter the tracker inside it:
    it makes what the meta kernels make differently, `_device_layer_norm`)."""
    token = _FAKE_CUDA.set(cuda)
    try:
        with contextlib.ExitStack() as stack:
            mode = stack.enter_context(FakeTensorMode())
            if cuda:
                stack.enter_context(cuda_kernels())
            yield mode
    finally:
        _FAKE_CUDA.reset(token)
