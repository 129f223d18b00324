"""One optimizer group's parameters of one dtype, laid out in one flat buffer split into dp
equal shards: the unit ZeRO-1/2 reduce, step and gather.

The parameters become views of the flat weight buffer, so all-gathering the updated shards
into it updates every layer at once. Each parameter's fp32 gradient accumulates into its view
of a flat fp32 buffer (`main_grad`), whatever dtype the weight is kept in: a low-precision
weight's gradient is added there by a hook, as `WeightCopies` adds it into the master, and an
fp32 weight's `.grad` is that view itself (autograd adds in place).

Under tensor parallelism the parameters are DTensors and each tp rank flattens its local
shards: the buffers are plain tensors of this rank's slices, reduced over the dp replicas of
its (stage, tp coordinate), and each DTensor is swapped in place (identity kept, so ties and
module references hold) for one whose local tensor is its view of the buffer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from engine.comm.dtensor import is_dtensor
from engine.parallel.tensor_parallel import local_tensor

__all__ = [
    "FlatGroup",
    "add_into_main_grad",
    "castable_linear_params",
    "laid_out_as",
    "local_gradient",
]


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
    shape: torch.Size
    """The parameter's local shape (its tp shard's, or its own)."""

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
            local = local_tensor(param)
            slots.append(_Slot(param, offset, local.numel(), local.shape))
            offset += local.numel()
        self.slots: tuple[_Slot, ...] = tuple(slots)
        self.numel = offset
        padded = -(-offset // dp) * dp
        self.shard_numel = padded // dp
        self.shard = slice(dp_rank * self.shard_numel, (dp_rank + 1) * self.shard_numel)
        self.weights = torch.zeros(padded, dtype=dtype, device=params[0].device)
        full = self.flatten(lambda p: local_tensor(p.detach()))
        with torch.no_grad():
            self.weights.copy_(full)
            for slot in self.slots:
                _rebind(slot.param, self.weights[slot.start : slot.stop].view(slot.shape))
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
            view = self.grads[slot.start : slot.stop].view(slot.shape)
            slot.param.main_grad = view  # type: ignore[attr-defined]
            fp32 = slot.param.dtype == torch.float32
            slot.param.grad = laid_out_as(slot.param, view) if fp32 else None

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
        """A full flat fp32 tensor built from one tensor per parameter, of its local shape
        (padding zero)."""
        out = torch.zeros(self.padded, dtype=torch.float32, device=self.weights.device)
        for slot in self.slots:
            out[slot.start : slot.stop].copy_(per_param(slot.param).reshape(-1))
        return out

    def unflatten(self, full: torch.Tensor) -> dict[int, torch.Tensor]:
        """Each parameter's part of a full flat tensor (views of its local shape), by id."""
        return {
            id(slot.param): full[slot.start : slot.stop].view(slot.shape) for slot in self.slots
        }


def add_into_main_grad(param: torch.Tensor) -> None:
    """A low-precision weight's post-accumulate hook: move its gradient into the fp32
    `main_grad`, widened by the add (the bits `WeightCopies` gives its master's `.grad`)."""
    grad, param.grad = param.grad, None
    main = getattr(param, "main_grad", None)
    if grad is not None and main is not None:
        main.add_(local_gradient(param, grad))


def local_gradient(param: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """`grad` as a tensor of `param`'s local shape, to add into its `main_grad`: a DTensor
    gradient laid out as the parameter first (DTensor's backward may leave a sharded weight's
    gradient replicated or partial), then its local tensor; a plain one as it is."""
    if not is_dtensor(grad):
        return grad
    if is_dtensor(param) and grad.placements != param.placements:
        grad = grad.redistribute(param.device_mesh, param.placements)
    return grad.to_local()


def laid_out_as(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """`local` (of `param`'s local shape) as a tensor laid out as `param`: a DTensor on its
    mesh and placements, or `local` itself."""
    if not is_dtensor(param):
        return local
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(
        local,
        param.device_mesh,
        param.placements,
        shape=param.shape,
        stride=param.stride(),
        run_check=False,
    )


def _rebind(param: nn.Parameter, view: torch.Tensor) -> None:
    """Make `view` (of the flat buffer) the parameter's storage, keeping its identity: a plain
    one by `.data`; a DTensor is swapped for one whose local tensor is the view (a DTensor's
    `.data` would change its dtype, not its local tensor)."""
    if not is_dtensor(param):
        param.data = view
        return
    new = nn.Parameter(laid_out_as(param, view), requires_grad=param.requires_grad)
    torch.utils.swap_tensors(param, new)
