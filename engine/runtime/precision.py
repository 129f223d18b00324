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
from dataclasses import dataclass, field

import torch

from engine.config import PRECISIONS, EngineOptions

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
    """fp16's loss scale (mutable: it grows and backs off), with DeepSpeed's semantics
    (`DynamicLossScaler`): an overflow skips the step and, once `hysteresis` overflows have
    been absorbed, halves the scale (never below `min_scale`); the scale doubles when the
    steps since the last overflow reach a multiple of `window`. A static scale never moves.
    Where DeepSpeed's ZeRO optimizers stop the run on an overflow at the minimum scale,
    meshpipe keeps skipping (each counted in the run's skipped steps), as DeepSpeed's fp16
    optimizer without ZeRO does."""

    scale: float = 2.0**16
    window: int = 2000
    min_scale: float = 1.0
    hysteresis: int = 1
    consecutive_hysteresis: bool = False
    dynamic: bool = True
    _iteration: int = 0
    _last_overflow: int = -1
    _hysteresis_left: int = field(default=-1)

    def __post_init__(self) -> None:
        if self._hysteresis_left < 0:
            self._hysteresis_left = self.hysteresis

    @staticmethod
    def of(options: EngineOptions) -> LossScaler | None:
        """The scaler `options` ask for: None unless fp16."""
        if options.precision != "fp16":
            return None
        if options.loss_scale > 0:
            return LossScaler(scale=options.loss_scale, dynamic=False)
        return LossScaler(
            scale=2.0**options.initial_scale_power,
            window=options.loss_scale_window,
            min_scale=options.min_loss_scale,
            hysteresis=options.hysteresis,
            consecutive_hysteresis=options.consecutive_hysteresis,
        )

    def state_dict(self) -> dict[str, float]:
        """What a resumed run needs to scale and grow exactly as this one would have."""
        return {
            "scale": self.scale,
            "iteration": self._iteration,
            "last_overflow": self._last_overflow,
            "hysteresis_left": self._hysteresis_left,
        }

    def load_state_dict(self, state: dict[str, float]) -> None:
        """A state of `state_dict`, or of the older form ({scale, good_steps})."""
        self.scale = float(state["scale"])
        if "good_steps" in state:
            self._iteration, self._last_overflow = int(state["good_steps"]), -1
            self._hysteresis_left = self.hysteresis
            return
        self._iteration = int(state["iteration"])
        self._last_overflow = int(state["last_overflow"])
        self._hysteresis_left = int(state["hysteresis_left"])

    def update(self, finite: bool) -> None:
        """After a step: absorb or back off on overflow (the step was skipped), grow after a
        window of good steps."""
        if self.dynamic and not finite:
            if self.hysteresis == 1 or self._hysteresis_left == 1:
                self.scale = max(self.scale / 2.0, self.min_scale)
            else:
                self._hysteresis_left -= 1
            self._last_overflow = self._iteration
        elif self.dynamic:
            if self.consecutive_hysteresis:
                self._hysteresis_left = self.hysteresis
            stable = self._iteration - self._last_overflow - 1
            if stable > 0 and stable % self.window == 0:
                self._hysteresis_left = self.hysteresis
                self.scale *= 2.0
        self._iteration += 1
