"""One low-precision copy of a stage's Linear weights per step, with gradients that go
straight into the fp32 masters.

Under autocast each Linear casts its fp32 weight to the compute dtype, and its weight
gradient comes back through that cast: a bf16 GEMM result, widened to a new fp32 tensor,
then added to `.grad`. For a stage of 1B parameters that widening writes and reads 8 GB per
micro-batch, and a compiled layer also casts the weights inside its graph for every
micro-batch (it cannot see autocast's cache). Here a stage's Linears hold bf16/fp16 leaf
copies for the step instead: autocast leaves them as they are (no cast), and each copy's
gradient is added into its master's fp32 `.grad` by one mixed-dtype add, which rounds
exactly as widening first and adding after. Losses and gradients keep every bit.

Only Linears: autocast runs embeddings and norms in fp32, so their weights are never cast. A
weight a Linear shares with another kind of module (GPT's head tied to the embedding, in one
stage) keeps autocast's cast: autograd sums the two uses' gradients before it adds them to
`.grad`, and adding the copy's part on its own would round differently.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

__all__ = ["WeightCopies"]


class WeightCopies:
    """The low-precision copies of one module tree's Linear parameters, installed for a step.

    `install` swaps every fp32 Linear parameter for a copy in `dtype` (a parameter shared by
    two Linears gets one copy, one shared with another kind of module none); `restore` puts
    the masters back and drops the copies, so it must run before the optimizer changes the
    masters and before anything else reads the module's parameters. Eval steps keep the
    masters (a copy made under no_grad would carry no gradient to them).
    """

    def __init__(self, module: nn.Module, dtype: torch.dtype) -> None:
        self.module, self.dtype = module, dtype
        self._slots: list[tuple[nn.Module, str, nn.Parameter]] = []
        self._masters: dict[int, nn.Parameter] = {}
        self.installed = False

    def install(self) -> None:
        """Cast every Linear's fp32 parameters once for this step (a no-op if installed).

        The slots are found now, not when the stage was built, so parameters replaced since
        (a loaded checkpoint, fake ones for the memory model) are the ones cast and restored.
        """
        if self.installed:
            return
        self.installed = True
        slots = [
            (module, name, param)
            for module in self.module.modules()
            for name, param in module.named_parameters(recurse=False, remove_duplicate=False)
        ]
        elsewhere = {id(param) for module, _, param in slots if not isinstance(module, nn.Linear)}
        self._slots = [
            (linear, name, param)
            for linear, name, param in slots
            if isinstance(linear, nn.Linear)
            and id(param) not in elsewhere
            and param.requires_grad
            and param.dtype == torch.float32
        ]
        copies: dict[int, nn.Parameter] = {}
        for linear, name, master in self._slots:
            copy = copies.get(id(master))
            if copy is None:
                with torch.no_grad():
                    copy = nn.Parameter(master.to(self.dtype))
                copy.register_post_accumulate_grad_hook(_add_into(master))
                copies[id(master)] = copy
                self._masters[id(copy)] = master
            setattr(linear, name, copy)

    def restore(self) -> None:
        """Put the fp32 masters back; the copies go with the step's last reference."""
        for linear, name, master in self._slots:
            setattr(linear, name, master)
        self._slots.clear()
        self._masters.clear()
        self.installed = False

    def master(self, param: nn.Parameter) -> nn.Parameter:
        """The fp32 parameter behind `param` (itself when it is not a copy)."""
        return self._masters.get(id(param), param)


def _add_into(master: nn.Parameter) -> Callable[[torch.Tensor], None]:
    """A copy's post-accumulate hook: move its gradient into the master's, widened by the add."""

    def hook(copy: torch.Tensor) -> None:
        grad, copy.grad = copy.grad, None
        if grad is None:
            return
        if master.grad is None:
            master.grad = grad.to(master.dtype)
        else:
            master.grad.add_(grad)

    return hook
