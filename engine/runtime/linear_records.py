"""What a split micro-batch's forward records of each Linear for its W.

Only a GEMM's weight gradient (gᵀ·x of every `nn.Linear`) is worth deferring, and it needs
only the Linear's input and its output's gradient. Forward hooks record both while a split
micro-batch runs its forward (`LinearRecorder.recording`); the I pass asks autograd for the
gradients at the recorded edges, and W runs the GEMM (`engine.runtime.weight_grads`).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator

import torch
from torch import nn
from torch.autograd.graph import get_gradient_edge

from engine.runtime.weight_grads import Recorded

__all__ = ["LinearRecorder"]


class LinearRecorder:
    """Hooks on a stage's Linears, recording into the list `recording` is given."""

    def __init__(self) -> None:
        self._records: list[Recorded] | None = None
        self._casts: dict[int, tuple[weakref.ref[torch.Tensor], torch.Tensor]] = {}
        """This forward's Linear inputs narrowed for W (`_narrow_input`), by the wider input."""
        self._kept_input: dict[nn.Module, torch.Tensor] = {}

    def install(self, module: nn.Linear) -> None:
        """Hook `module`. Under tensor parallelism, after the plan's input hook (the input is
        narrowed where the GEMM reads it) and before its output hook (the edge is the GEMM's
        own output, a DTensor, whose gradient is what the shard's W needs even where the plan
        reduce-scatters the output along the sequence)."""
        module.register_forward_pre_hook(self._narrow_input)
        module.register_forward_hook(self._record_output, prepend=True)

    @contextlib.contextmanager
    def recording(self, records: list[Recorded] | None) -> Iterator[None]:
        """Record into `records` within (nothing where None: a fused micro-batch's forward)."""
        self._records = records
        try:
            yield
        finally:
            self._records = None
            self._casts.clear()
            self._kept_input.clear()

    def _narrow_input(
        self, module: nn.Module, args: tuple[torch.Tensor, ...]
    ) -> tuple[torch.Tensor, ...] | None:
        """Under autocast, a split micro-batch's Linear gets its input already in the GEMM's
        dtype, cast as autocast casts it (per Linear, the same bits): the copy autograd saves
        is then one the record can keep for W. Recording the wider input held it from F to I
        besides (the norms' fp32 outputs: 15 % of a llama3-70b block's stash awaiting I).
        Linears reading one input (q, k and v) each get their own cast, as under autocast,
        and W keeps the first of them for all (`_casts`)."""
        x = args[0]
        if self._records is None or not x.is_floating_point():
            return None
        device = x.device.type
        if not torch.is_autocast_enabled(device):
            return None
        dtype = torch.get_autocast_dtype(device)
        if x.dtype == dtype:
            return None
        narrowed = x.to(dtype)
        known = self._casts.get(id(x))
        if known is None or known[0]() is not x:  # an id reused once its tensor was freed
            known = self._casts[id(x)] = (weakref.ref(x), narrowed.detach())
        self._kept_input[module] = known[1]
        return (narrowed, *args[1:])

    def _record_output(
        self, module: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor
    ) -> None:
        """Record a Linear's input (detached: W needs its values, not its graph) and its
        output's gradient edge: I asks for that gradient by the edge, so the output itself is
        not kept (a Linear output autograd does not save, the LM head's logits, every
        projection before a residual add, is freed after the forward, as in a fused
        backward)."""
        if self._records is None or not output.requires_grad:
            return
        x = self._kept_input.pop(module, None)  # `_narrow_input`'s, where it narrowed
        x = inputs[0].detach() if x is None else x
        self._records.append((module, x, get_gradient_edge(output)))
