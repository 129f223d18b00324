"""Training options the engine applies on every stage and rank, validated once."""

from __future__ import annotations

from dataclasses import dataclass

from engine.runtime.precision import PRECISIONS

__all__ = ["EngineOptions", "recompute_groups"]


def recompute_groups(num_layers: int, policy: str) -> list[tuple[range, bool]]:
    """Split a stage's layers into runs, each marked whether to recompute it in backward.

    `none`: one run, kept. `full`: one run, recomputed (only the stage input stays in flight).
    `every:N`: runs of N layers, each recomputed (its input stays in flight).
    """
    if policy == "none":
        return [(range(num_layers), False)]
    if policy == "full":
        return [(range(num_layers), True)]
    if policy.startswith("every:"):
        try:
            size = int(policy.split(":", 1)[1])
        except ValueError:
            size = 0
        if size >= 1:
            return [(range(k, min(k + size, num_layers)), True) for k in range(0, num_layers, size)]
    raise ValueError(f"unknown recompute policy {policy!r}: use none, full or every:N with N >= 1")


@dataclass(frozen=True, kw_only=True)
class EngineOptions:
    """How each step computes. Recomputation and ZeRO-1 leave the numbers as they are;
    precision, clipping and the guard's skipped steps change them, as they would in one process."""

    precision: str = "fp32"
    """`fp32`, `bf16` (autocast, fp32 master weights and grads) or `fp16` (plus loss scaling)."""
    clip_grad_norm: float = 0.0
    """Clip the global gradient norm to this value (0 disables clipping)."""
    recompute: str = "none"
    """Activation recomputation per stage: `none`, `full` or `every:N` layers."""
    zero: int = 0
    """1 shards optimizer state over the data-parallel replicas (ZeRO-1)."""
    compile: bool = False
    """`torch.compile` each layer (regional compilation: one graph per layer class, reused by
    every block). Fuses the norms, rotary and activations that eager runs as separate memory-
    bound kernels; numbers agree with eager to rounding, not bit for bit. Not with a split
    backward: a compiled layer hides the Linears whose weight gradients W defers."""
    nonfinite_guard: bool = True
    """Skip a step whose loss or gradients are not finite on every rank together. Costs one
    blocking all-reduce per step when neither clipping nor fp16 needs one anyway: the next
    step's warm-up then cannot overlap this step's drain ((P-1) forwards of bubble per step)."""

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise ValueError(
                f"unknown precision {self.precision!r}: choose one of {', '.join(PRECISIONS)}"
            )
        if self.clip_grad_norm < 0:
            raise ValueError(f"clip_grad_norm={self.clip_grad_norm} must be >= 0 (0 disables)")
        recompute_groups(1, self.recompute)
        if self.zero not in (0, 1):
            raise ValueError(f"zero={self.zero}: meshpipe supports ZeRO stage 0 or 1")
