"""StepStats: what one pipeline step measured on a rank, and the bubble its figures give."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from engine.runtime.interpreter import ActionTiming

__all__ = ["StepStats", "pipeline_bubble", "published_figures"]


@dataclass(frozen=True, kw_only=True)
class StepStats:
    """What one step measured on this rank.

    `bubble` and `grad_norm` need every pipeline rank's figures, which arrive without a
    barrier: reading them right after the step waits until every peer has finished it; the
    engine has them anyway by the end of the next step.
    """

    loss: float
    """Mean loss over the global batch (the same on every rank)."""
    step_s: float
    """Seconds the schedule took on this rank."""
    busy_s: float
    """Seconds of compute (F, B, I, W) on this rank."""
    in_flight_peak: dict[int, int]
    """Peak micro-batches in flight (F done, B or I not) per stage held by this rank."""
    pending_w_peak: dict[int, int]
    """Peak micro-batches waiting for their W (I done) per stage held by this rank."""
    timings: tuple[ActionTiming, ...]
    """Every action's start and end on this rank, in seconds from the step's start."""
    phases: tuple[tuple[str, float, float], ...] = ()
    """Work outside the schedule (DP all-reduce, tied-weight sum, optimizer), same clock."""
    skipped: bool = False
    """True when a non-finite loss or gradient made every rank skip the optimizer step."""
    loss_scale: float = 1.0
    """fp16's loss scale used in this step (1 otherwise)."""
    pipeline_figures: Callable[[], tuple[float, float]] = field(
        default=lambda: (0.0, 0.0), repr=False, compare=False
    )
    """Resolves (bubble, grad norm) from every pipeline rank's figures."""

    def phase_seconds(self) -> dict[str, float]:
        """Seconds this rank spent per phase of the step: each compute kind (F, B, I, W)
        summed over micro-batches, p2p waits together, then each phase outside the schedule
        (what DeepSpeed's wall_clock_breakdown reports as forward, backward, step)."""
        seconds: dict[str, float] = {}
        for timing in self.timings:
            kind = timing.action.kind.value if timing.action.is_compute else "p2p"
            seconds[kind] = seconds.get(kind, 0.0) + timing.end - timing.start
        for name, start, end in self.phases:
            seconds[name] = seconds.get(name, 0.0) + end - start
        return seconds

    @property
    def bubble(self) -> float:
        """Pipeline bubble over this replica's ranks: 1 - sum(busy) / (P * slowest step)."""
        return self.pipeline_figures()[0]

    @property
    def grad_norm(self) -> float:
        """Global gradient norm before clipping (the same on every rank)."""
        return self.pipeline_figures()[1]


def pipeline_bubble(busy: Sequence[float], step_s: Sequence[float]) -> float:
    """1 - sum(busy) / (ranks · slowest step): the idle share of the pipeline's ranks."""
    slowest = max(step_s)
    return 1.0 - sum(busy) / (len(busy) * slowest) if slowest > 0 else 0.0


def published_figures(
    busy: float,
    step_s: float,
    *,
    norm: float | None,
    local_norms: Callable[[], torch.Tensor],
    publish: Callable[[torch.Tensor], Callable[[], torch.Tensor]] | None,
) -> Callable[[], tuple[float, float]]:
    """Send (busy, step seconds, per-parameter gradient norms unless `norm` is known) to the
    pipeline peers (`publish`; None without any); the result resolves (bubble, global norm)
    once theirs arrived, so no step waits for its peers' figures."""
    mine = torch.tensor([busy, step_s], dtype=torch.float64)
    if norm is None:
        mine = torch.cat([mine, local_norms().cpu().to(torch.float64)])
    gather = publish(mine) if publish is not None else lambda: mine[None]

    @functools.cache
    def figures() -> tuple[float, float]:
        every = gather()
        bubble = pipeline_bubble(every[:, 0].tolist(), every[:, 1].tolist())
        if norm is not None:
            return bubble, norm
        total = every[:, 2:].sum(0).to(torch.float32)
        return bubble, float(torch.linalg.vector_norm(total, 2.0))

    return figures
