"""One optimizer group's parameters of one dtype, laid out in one flat buffer split into dp
equal shards: the unit ZeRO-1/2 reduce, step and gather.

The parameters become views of the flat weight buffer, so all-gathering the updated shards
into it updates every layer at once. Each parameter's fp32 gradient accumulates into its view
of a flat fp32 buffer (`main_grad`), whatever dtype the weight is kept in: a low-precision
weight's gradient is added there by a hook, as `WeightCopies` adds it into the master, and an
fp32 weight's `.grad` is that view itself (autograd adds in place).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["FlatGroup", "add_into_main_grad", "castable_linear_params"]


def castable_linear_params(module: nn.Module) -> list[nn.Parameter]:
    """The fp32 parameters autocast would cast: those of Linears, unless a non-Linear module
    also uses them (GPT's head tied to its embedding in one stage keeps autocast's cast, whose
    gradient autograd sums over both uses), each once."""
    slots = [
        (owner, param) for owner in module.modules() for param in owner.parameters(recurse=False)
    ]
    elsewhere = {id(p) for owner, p in slots if not isinstance(owner, nn.Linear)}
    found: dict[int, nn.Parameter] = {}
    for owner, param in slots:
        if (
            isinstance(owner, nn.Linear)
            and id(param) not in elsewhere
            and param.requires_grad
            and param.dtype == torch.float32
        ):
            found.setdefault(id(param), param)
    return list(found.values())


@dataclass(frozen=True)
class _Slot:
    param: nn.Parameter
    start: int
    numel: int

    @property
    def stop(self) -> int:
        return self.start + self.numel


class FlatGroup:
    """Parameters of one optimizer group kept in one `dtype`, as views of a flat buffer.

    The buffer is padded to a multiple of `dp` (the padding's gradient, master and moments stay
    zero), and `shard` is this rank's `[start, stop)` of it.
    """

    def __init__(
        self, params: Sequence[nn.Parameter], dtype: torch.dtype, *, dp: int, dp_rank: int
    ) -> None:
        """Moves `params` (fp32) into the buffer, cast to `dtype`; `master` is this rank's fp32
        shard of their values: a copy when `dtype` is narrower, else a view of the buffer."""
        self.dtype = dtype
        slots, offset = [], 0
        for param in params:
            slots.append(_Slot(param, offset, param.numel()))
            offset += param.numel()
        self.slots: tuple[_Slot, ...] = tuple(slots)
        self.numel = offset
        padded = -(-offset // dp) * dp
        self.shard_numel = padded // dp
        self.shard = slice(dp_rank * self.shard_numel, (dp_rank + 1) * self.shard_numel)
        self.weights = torch.zeros(padded, dtype=dtype, device=params[0].device)
        full = self.flatten(lambda p: p.detach())
        with torch.no_grad():
            self.weights.copy_(full)
            for slot in self.slots:
                slot.param.data = self.weights[slot.start : slot.stop].view_as(slot.param)
        narrow = dtype != torch.float32
        self.master = full[self.shard].clone() if narrow else self.weights[self.shard]
        """This rank's fp32 master shard: what the optimizer steps."""
        self.shard_grad: torch.Tensor | None = None
        """This rank's reduced fp32 gradient shard, once the reduction finished."""
        self.grads: torch.Tensor | None = None
        """The full fp32 gradient buffer of the step (None when not accumulating)."""

    @property
    def padded(self) -> int:
        return self.weights.numel()

    def owned(self) -> list[tuple[_Slot, slice, slice]]:
        """The parameters overlapping this rank's shard: (slot, range in the parameter's
        flattened elements, range in the shard)."""
        found = []
        for slot in self.slots:
            start, stop = max(slot.start, self.shard.start), min(slot.stop, self.shard.stop)
            if start < stop:
                found.append(
                    (
                        slot,
                        slice(start - slot.start, stop - slot.start),
                        slice(start - self.shard.start, stop - self.shard.start),
                    )
                )
        return found

    def begin_accumulation(self) -> None:
        """A zeroed fp32 gradient buffer; each parameter's `main_grad` is its view of it, and
        an fp32 parameter's `.grad` too (autograd adds into it in place, as into `.grad`)."""
        self.grads = torch.zeros(self.padded, dtype=torch.float32, device=self.weights.device)
        for slot in self.slots:
            view = self.grads[slot.start : slot.stop].view_as(slot.param)
            slot.param.main_grad = view  # type: ignore[attr-defined]
            slot.param.grad = view if slot.param.dtype == torch.float32 else None

    def end_accumulation(self) -> None:
        """Drop the full gradient buffer and every view of it (ZeRO-2 keeps only its shard)."""
        self.grads = None
        for slot in self.slots:
            slot.param.main_grad = None  # type: ignore[attr-defined]
            slot.param.grad = None

    def scatter_full(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's shard of a full flat tensor laid out like the buffer (a view)."""
        return full[self.shard]

    def flatten(self, per_param: Callable[[nn.Parameter], torch.Tensor]) -> torch.Tensor:
        """A full flat fp32 tensor built from one tensor per parameter (padding zero)."""
        out = torch.zeros(self.padded, dtype=torch.float32, device=self.weights.device)
        for slot in self.slots:
            out[slot.start : slot.stop].copy_(per_param(slot.param).reshape(-1))
        return out

    def unflatten(self, full: torch.Tensor) -> dict[int, torch.Tensor]:
        """Each parameter's part of a full flat tensor (views), by parameter id."""
        return {
            id(slot.param): full[slot.start : slot.stop].view(slot.param.shape)
            for slot in self.slots
        }


def add_into_main_grad(param: torch.Tensor) -> None:
    """A low-precision weight's post-accumulate hook: move its gradient into the fp32
    `main_grad`, widened by the add (the bits `WeightCopies` gives its master's `.grad`)."""
    grad, param.grad = param.grad, None
    main = getattr(param, "main_grad", None)
    if grad is not None and main is not None:
        main.add_(grad)
