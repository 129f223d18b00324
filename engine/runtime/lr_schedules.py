"""Learning-rate schedules: the multiplier of the base rate at every step, ours (linear warmup,
then constant, cosine or linear decay) or a DeepSpeed scheduler's exact values.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from typing import Any

from engine.config import LR_SCHEDULES, LRSchedule
from engine.config.optimizer import check_scheduler_params

__all__ = ["deepspeed_lr", "lr_factor", "lr_multiplier"]


def lr_multiplier(schedule: LRSchedule, *, total_steps: int, lr: float) -> Callable[[int], float]:
    """Multiplier of the base lr per step: ours, or a DeepSpeed scheduler's exact values."""
    kind = schedule.deepspeed_kind
    if kind is not None:
        params = json.loads(schedule.lr_schedule_args)
        return lambda step: deepspeed_lr(step, kind, params, lr) / lr
    return lambda step: lr_factor(
        step,
        schedule=schedule.lr_schedule,
        warmup_steps=schedule.warmup_steps,
        total_steps=total_steps,
        min_ratio=schedule.min_lr_ratio,
    )


def lr_factor(
    step: int, *, schedule: str, warmup_steps: int, total_steps: int, min_ratio: float = 0.1
) -> float:
    """Multiplier of the base learning rate at `step` (0-based): linear warmup, then decay.

    `cosine` and `linear` decay from 1 to `min_ratio` between the end of warmup and
    `total_steps`; `constant` stays at 1 after warmup.
    """
    if schedule not in LR_SCHEDULES:
        raise ValueError(
            f"unknown lr schedule {schedule!r}: choose one of {', '.join(LR_SCHEDULES)}"
        )
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant" or total_steps <= warmup_steps:
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    if schedule == "linear":
        return 1.0 - (1.0 - min_ratio) * progress
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def deepspeed_lr(step: int, kind: str, params: Mapping[str, Any], base_lr: float) -> float:
    """The learning rate DeepSpeed's scheduler gives training step `step` (0-based).

    DeepSpeed steps its scheduler after each optimizer step, so step k runs at the scheduler's
    iteration k - 1, and step 0 at its initial value. The params are checked on every call, so
    a schedule given by flags (not a JSON) fails at step 0, when the scheduler is built.
    """
    check_scheduler_params(kind, params)
    it = step - 1
    warmup = max(2, int(params.get("warmup_num_steps", 1000)))
    log_rate = params.get("warmup_type", "log") == "log"
    ramp = (math.log(it + 1) / math.log(warmup) if log_rate else it / warmup) if it >= 0 else 0.0
    if kind == "WarmupCosineLR":
        if it < 0:
            return 0.0
        if it < warmup:
            low = float(params.get("warmup_min_ratio", 0.0))
            return base_lr * (low + ramp * (1.0 - low))
        total = max(1, int(params["total_num_steps"]) - warmup)
        progress = min(1.0, (it - warmup + 1) / total)
        floor = float(params.get("cos_min_ratio", 0.0001))
        return base_lr * max(0.0, floor + (1 - floor) * (1 + math.cos(math.pi * progress)) / 2)
    low = float(params.get("warmup_min_lr", 0.0))
    # DeepSpeed's WarmupLR warms up to the optimizer's lr by default; WarmupDecayLR to 0.001.
    high = float(params.get("warmup_max_lr", base_lr if kind == "WarmupLR" else 0.001))
    if it < 0:
        return low
    if it < warmup:
        gamma = ramp
    elif kind == "WarmupDecayLR":
        total = int(params["total_num_steps"])
        gamma = max(0.0, (total - it) / max(1.0, total - warmup))
    else:
        gamma = 1.0
    return low + (high - low) * gamma
