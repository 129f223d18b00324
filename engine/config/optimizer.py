"""The optimizer (its kind, kernel and hyper-parameters) and its learning-rate schedule."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from engine.config.fields import flat, require

__all__ = [
    "DEEPSPEED_SCHEDULERS",
    "IMPLEMENTATIONS",
    "LR_SCHEDULES",
    "OPTIMIZERS",
    "LRSchedule",
    "OptimizerSpec",
    "check_scheduler_params",
    "json_object",
    "no_auto",
]

OPTIMIZERS = ("adamw", "sgd")
IMPLEMENTATIONS = ("fused", "per_tensor", "deepspeed_cpu")
"""How the update runs: torch's fused CPU/CUDA kernel (default), torch's per-tensor loop, or
DeepSpeed's CPU Adam (AdamW only; fastest on CPU, see docs/BENCHMARKS.md)."""
LR_SCHEDULES = ("constant", "cosine", "linear")
DEEPSPEED_SCHEDULERS = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR")
_WARMUP_PARAMS = (
    "warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type", "last_batch_iteration",
)  # fmt: skip
_SCHEDULER_PARAMS = {
    "WarmupLR": _WARMUP_PARAMS,
    "WarmupDecayLR": ("total_num_steps", *_WARMUP_PARAMS),
    "WarmupCosineLR": (
        "total_num_steps", "warmup_min_ratio", "warmup_num_steps", "cos_min_ratio",
        "warmup_type", "last_batch_iteration",
    ),
}  # fmt: skip
"""The keyword arguments of each scheduler's constructor in DeepSpeed's lr_schedules.py."""
_WARMUP_TYPES = ("log", "linear")


def _parse_betas(text: Any) -> tuple[float, float]:
    """Adam's betas from their flat form, `0.9,0.95`."""
    if isinstance(text, tuple):
        betas: tuple[float, ...] = text
    else:
        try:
            betas = tuple(float(b) for b in str(text).split(","))
        except ValueError:
            betas = ()
    require(len(betas) == 2, f"betas={text!r}: give two numbers such as 0.9,0.95")
    require(all(0 <= b < 1 for b in betas), f"betas={text!r}: each must be in [0, 1)")
    return betas[0], betas[1]


def _betas_text(betas: tuple[float, float]) -> str:
    return ",".join(str(b) for b in betas)


@dataclass(frozen=True, kw_only=True)
class OptimizerSpec:
    """An optimizer by name and hyper-parameters, buildable plain or sharded (ZeRO-1) by
    `engine.runtime.optim.build_from_spec`."""

    name: str = field(default="adamw", metadata=flat("optimizer"))
    """adamw or sgd."""
    lr: float = 1e-3
    """Peak learning rate."""
    weight_decay: float = 0.0
    """Decoupled weight decay on matrices (not on norms and biases)."""
    betas: tuple[float, float] = field(
        default=(0.9, 0.95), metadata=flat(parse=_parse_betas, text=_betas_text)
    )
    """AdamW's betas, comma-separated."""
    momentum: float = 0.0
    """SGD's momentum."""
    eps: float = field(default=1e-8, metadata=flat("adam_eps"))
    """AdamW's epsilon, added to the root of the second moment (Llama recipes use 1e-5)."""
    impl: str = field(default="fused", metadata=flat("optimizer_impl"))
    """Optimizer kernel: fused (torch), per_tensor (torch) or deepspeed_cpu (AdamW only)."""

    def __post_init__(self) -> None:
        require(
            self.name in OPTIMIZERS,
            f"unknown optimizer {self.name!r}: choose one of {', '.join(OPTIMIZERS)}",
        )
        require(
            self.impl in IMPLEMENTATIONS,
            f"unknown optimizer implementation {self.impl!r}: choose one of "
            f"{', '.join(IMPLEMENTATIONS)}",
        )
        require(
            not (self.name == "sgd" and self.impl == "deepspeed_cpu"),
            "deepspeed_cpu implements AdamW only: use fused or per_tensor",
        )
        require(self.lr > 0, f"lr={self.lr} must be positive")
        require(
            0.0 < self.eps < math.inf,
            f"adam_eps={self.eps} must be a positive number such as 1e-8",
        )
        require(self.weight_decay >= 0, f"weight_decay={self.weight_decay} must be >= 0")
        require(0 <= self.momentum < 1, f"momentum={self.momentum} must be in [0, 1)")
        _parse_betas(self.betas)


@dataclass(frozen=True, kw_only=True)
class LRSchedule:
    """How the learning rate moves over the run."""

    lr_schedule: str = "cosine"
    """One of constant, cosine, linear (after warmup), or deepspeed:<Type> (WarmupLR,
    WarmupDecayLR, WarmupCosineLR with --lr-schedule-args)."""
    warmup_steps: int = 10
    """Steps of linear warmup from lr/warmup_steps to lr."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of `lr` for decaying schedules."""
    lr_schedule_args: str = "{}"
    """JSON parameters of a deepspeed:<Type> lr schedule (WarmupLR, WarmupDecayLR, …)."""

    def __post_init__(self) -> None:
        known = (*LR_SCHEDULES, *(f"deepspeed:{k}" for k in DEEPSPEED_SCHEDULERS))
        require(
            self.lr_schedule in known,
            f"unknown lr schedule {self.lr_schedule!r}: choose one of {', '.join(known)}",
        )
        require(0.0 <= self.min_lr_ratio <= 1.0, f"min_lr_ratio={self.min_lr_ratio} not in [0, 1]")
        require(self.warmup_steps >= 0, f"warmup_steps={self.warmup_steps} must be >= 0")
        args = json_object(self.lr_schedule_args)
        if self.deepspeed_kind is None:
            require(
                args == {},
                f"--lr-schedule-args {self.lr_schedule_args} is for the deepspeed:* schedules; "
                f"--lr-schedule {self.lr_schedule} takes --warmup-steps and --min-lr-ratio",
            )
            return
        require(
            args is not None,
            f"--lr-schedule-args {self.lr_schedule_args!r} is not a JSON object: give the "
            "scheduler's parameters such as '{\"warmup_num_steps\": 100}'",
        )
        assert args is not None
        check_scheduler_params(self.deepspeed_kind, args)

    @property
    def deepspeed_kind(self) -> str | None:
        """The DeepSpeed scheduler's type for deepspeed:<Type>, else None."""
        prefix, _, kind = self.lr_schedule.partition(":")
        return kind if prefix == "deepspeed" else None


def json_object(text: str) -> dict[str, Any] | None:
    """`text` parsed as a JSON object, or None when it is not one."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


def no_auto(value: Any, key: str) -> None:
    """Refuse a Hugging Face Trainer "auto" placeholder where a number belongs."""
    require(
        value != "auto",
        f'{key}="auto": only the Hugging Face Trainer fills in "auto" values, DeepSpeed and '
        "meshpipe need a number: write the value (or remove the key for the default)",
    )


def check_scheduler_params(kind: str, params: Mapping[str, Any]) -> None:
    """Reject before training what DeepSpeed's scheduler would reject when built (a misspelt
    or missing argument, a warmup_num_steps below 1), and what meshpipe would otherwise run
    differently (an unknown warmup_type, which DeepSpeed turns into log; a
    last_batch_iteration, which meshpipe does not replay)."""
    require(
        kind in DEEPSPEED_SCHEDULERS,
        f"scheduler type {kind!r} is not supported: use {', '.join(DEEPSPEED_SCHEDULERS)}",
    )
    for key, value in params.items():
        no_auto(value, f"scheduler.params.{key}")
    accepted = _SCHEDULER_PARAMS[kind]
    unknown = sorted(set(params) - set(accepted))
    require(
        not unknown,
        f"{kind} params {unknown} are not arguments of DeepSpeed's {kind}: "
        f"fix or remove them (accepted: {', '.join(accepted)})",
    )
    require(
        "total_num_steps" not in accepted or "total_num_steps" in params,
        f"{kind} needs params.total_num_steps (the step its decay ends at): add it, "
        "as DeepSpeed requires",
    )
    warmup = params.get("warmup_num_steps", 1)
    require(
        isinstance(warmup, int) and warmup >= 1,
        f"{kind} warmup_num_steps={warmup!r}: give a whole number of at least 1",
    )
    require(
        params.get("warmup_type", "log") in _WARMUP_TYPES,
        f"{kind} warmup_type={params.get('warmup_type')!r}: use {' or '.join(_WARMUP_TYPES)}",
    )
    require(
        params.get("last_batch_iteration", -1) == -1,
        f"{kind} last_batch_iteration={params.get('last_batch_iteration')!r} is not "
        "supported: remove it (meshpipe resumes a schedule from its checkpoint, --resume)",
    )
