"""What a resumed run keeps from the run that wrote its checkpoint.

A checkpoint's optimizer state carries the learning rate, weight decay, betas and eps it was
trained with, while clipping, precision and the learning-rate schedule come from this run's
flags. Resuming with changed flags would silently mix the two, so it is refused, naming each
change, unless the user asks for the new values: then all of them apply from the resumed step.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping
from typing import Any

import torch
from torch.optim.lr_scheduler import LambdaLR

from engine.config import TrainConfig

__all__ = ["check_resumable", "keep_new_hyperparameters", "optimizer_hyperparameters"]

RUN_DEFINING = (
    "model",
    "seed",
    "seq_len",
    "global_batch",
    "optimizer",
    "lr",
    "lr_schedule",
    "lr_schedule_args",
    "warmup_steps",
    "min_lr_ratio",
    "weight_decay",
    "betas",
    "adam_eps",
    "momentum",
    "clip_grad_norm",
    "precision",
)
"""Settings a resume must share with its checkpoint's run (layout and speed flags may change)."""

_DECAYING = ("cosine", "linear")
"""Schedules whose learning rate depends on --steps: longer runs change them too."""

_OPTIMIZER_KEYS = ("lr", "initial_lr", "weight_decay", "betas", "eps", "momentum")


def _changes(saved: Mapping[str, Any], config: TrainConfig) -> dict[str, tuple[Any, Any]]:
    """(checkpoint's, this run's) value of each run-defining setting that differs; settings
    the checkpoint does not record are not compared."""
    now = config.to_dict()
    names = list(RUN_DEFINING)
    if saved.get("lr_schedule") in _DECAYING or config.lr_schedule in _DECAYING:
        names.append("steps")
    return {n: (saved[n], now[n]) for n in names if n in saved and saved[n] != now[n]}


def check_resumable(saved: Mapping[str, Any], config: TrainConfig, step: int) -> str:
    """The changed run-defining settings, listed (empty when none); raises unless
    --resume-with-new-hparams asks for the new ones."""
    changes = _changes(saved, config)
    listed = "; ".join(f"{name}: {old!r} → {new!r}" for name, (old, new) in changes.items())
    if not changes or config.resume_with_new_hparams:
        return listed
    flags = " ".join(
        f"--{name.replace('_', '-')} {shlex.quote(str(old))}" for name, (old, _) in changes.items()
    )
    raise ValueError(
        f"the checkpoint of step {step} was trained with other settings ({listed}): resume with "
        f"the checkpoint's ({flags}), or add --resume-with-new-hparams to continue with the new "
        "ones from this step"
    )


def optimizer_hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Each parameter group's hyper-parameters, as this run built them."""
    return [{k: g[k] for k in _OPTIMIZER_KEYS if k in g} for g in optimizer.param_groups]


def keep_new_hyperparameters(
    optimizer: torch.optim.Optimizer, scheduler: LambdaLR, built: list[dict[str, Any]]
) -> None:
    """After loading a checkpoint's optimizer and schedule state, put back the
    hyper-parameters this run was built with and the learning rate its schedule gives now."""
    for group, values in zip(optimizer.param_groups, built, strict=True):
        group.update(values)
    scheduler.base_lrs = [group["initial_lr"] for group in optimizer.param_groups]
    step = scheduler.last_epoch
    for group, base, factor in zip(
        optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas, strict=True
    ):
        group["lr"] = base * factor(step)
