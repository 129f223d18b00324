"""Mixed precision: autocast compute, fp32 master weights, and fp16's dynamic loss scale.

Parameters and their gradients stay fp32 (autocast casts inside each op), so gradient
accumulation over micro-batches and the optimizer run in fp32; matmul outputs are in the
compute dtype and the residual stream stays fp32, as in one process. Tensors cross stages in
the compute dtype (half the traffic) and are widened back to fp32 on arrival, so a boundary
costs one rounding and nothing downstream. Each weight is cast once per step, not once per
micro-batch (`engine.weight_copies`, inside each stage's step scope). fp16's loss scale is
decided from the global gradient norm, which every rank computes identically, so every rank
skips or steps together.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from engine.config import PRECISIONS

__all__ = ["LossScaler", "autocast", "compute_dtype", "step_casts"]


def compute_dtype(precision: str) -> torch.dtype:
    """The dtype activations are computed and exchanged in."""
    try:
        return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    except KeyError:
        raise ValueError(
            f"unknown precision {precision!r}: choose one of {', '.join(PRECISIONS)}"
        ) from None


@contextlib.contextmanager
def autocast(precision: str, device: torch.device) -> Iterator[None]:
    """Autocast to the compute dtype (a no-op for fp32)."""
    dtype = compute_dtype(precision)
    if dtype is torch.float32:
        yield
        return
    with torch.autocast(device_type=device.type, dtype=dtype):
        yield


@contextlib.contextmanager
def step_casts(precision: str, device: torch.device) -> Iterator[None]:
    """Keep autocast's cast cache over a whole step, so every micro-batch shares one
    low-precision copy of each weight instead of casting (and keeping) its own.

    Autocast caches the casts of leaf fp32 tensors that require grad and clears the cache when
    its outermost context exits; each forward's own `autocast` exits, so without this the
    weights were cast again for every micro-batch and each in-flight micro-batch's graph held
    its own copies. An outer, disabled context keeps the cache open while leaving backwards
    and everything else outside autocast. It must close before the optimizer changes the
    weights in place (the cache is keyed by tensor, not by value), and eval steps get their own
    (casts made under no_grad carry no graph). The copies are the same bits a fresh cast gives,
    so losses and gradients are unchanged.
    """
    if compute_dtype(precision) is torch.float32:
        yield
        return
    with torch.autocast(device_type=device.type, enabled=False):
        yield


@dataclass
class LossScaler:
    """Dynamic loss scale for fp16 (mutable: it grows and backs off), as in AMP's GradScaler."""

    scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    min_scale: float = 1.0
    _good_steps: int = 0

    def state_dict(self) -> dict[str, float]:
        """What a resumed run needs to scale and grow exactly as this one would have."""
        return {"scale": self.scale, "good_steps": self._good_steps}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.scale = float(state["scale"])
        self._good_steps = int(state["good_steps"])

    def update(self, finite: bool) -> None:
        """After a step: back off on overflow (the step was skipped), grow after a good run."""
        if not finite:
            self.scale = max(self.min_scale, self.scale * self.backoff_factor)
            self._good_steps = 0
            return
        self._good_steps += 1
        if self._good_steps >= self.growth_interval:
            self.scale *= self.growth_factor
            self._good_steps = 0
