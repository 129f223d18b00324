"""What a resumed run keeps from the run that wrote its checkpoint.

A checkpoint's optimizer state carries the learning rate, weight decay, betas and eps it was
trained with, while clipping, precision and the learning-rate schedule come from this run's
flags. Resuming with changed flags would silently mix the two, so it is refused, naming each
change, unless the user asks for the new values: then all of them apply from the resumed step.
The model, the data order (seed, sequence length, global batch) and the optimizer's kind are
what the checkpoint's weights, data position and optimizer state mean: those never change in a
resumed run; a new run can start from the weights instead (`--init-from`).
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping
from typing import Any

import torch
from torch.optim.lr_scheduler import LambdaLR

from engine.training.config import TrainConfig
from engine.training.data import token_file_pair

__all__ = [
    "DECAYING_SCHEDULES",
    "FIXED_BY_CHECKPOINT",
    "NEW_WITH_FLAG",
    "check_resumable",
    "keep_new_hyperparameters",
    "optimizer_hyperparameters",
]

FIXED_BY_CHECKPOINT = (
    "model",
    "seed",
    "seq_len",
    "global_batch",
    "optimizer",
    "data_order",
    "val_fraction",
)
"""Settings the checkpoint's state is made of: its weights' shapes, its data order and its
optimizer state. No resume changes them."""

NEW_WITH_FLAG = (
    "data",
    "vocab_size",
    "tokenizer",
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
    "dp_sync",
    "sync_every",
    "outer_lr",
    "outer_momentum",
    "pack_documents",
)
"""Settings a resume shares with its checkpoint's run unless --resume-with-new-hparams asks
for the new ones (layout and speed flags may always change)."""

DECAYING_SCHEDULES = ("cosine", "linear")
"""Schedules whose learning rate depends on --steps: longer runs change them too."""

_OPTIMIZER_KEYS = ("lr", "initial_lr", "weight_decay", "betas", "eps", "momentum")


def _changes(
    saved: Mapping[str, Any], config: TrainConfig, names: tuple[str, ...]
) -> dict[str, tuple[Any, Any]]:
    """(checkpoint's, this run's) value of each of `names` that differs; settings the
    checkpoint does not record are not compared."""
    now = config.flat()
    return {
        n: (saved[n], now[n])
        for n in names
        if n in saved and _comparable(n, saved[n]) != _comparable(n, now[n])
    }


def _comparable(name: str, value: Any) -> Any:
    """A token file named by its prefix, .bin or .json, relative or not, is the same data."""
    if name != "data" or value is None:
        return value
    return token_file_pair(value)[0].resolve()


def _listed(changes: Mapping[str, tuple[Any, Any]]) -> str:
    return "; ".join(f"{name}: {old!r} → {new!r}" for name, (old, new) in changes.items())


def _flags(changes: Mapping[str, tuple[Any, Any]]) -> str:
    """The checkpoint's values as flags a shell takes ("no --data" for the default corpus)."""
    flags = {name: f"--{name.replace('_', '-')}" for name in changes}
    return " ".join(
        f"no {flags[name]}" if old is None else f"{flags[name]} {shlex.quote(str(old))}"
        for name, (old, _) in changes.items()
    )


def check_resumable(saved: Mapping[str, Any], config: TrainConfig, step: int, where: str) -> str:
    """The changed settings, listed (empty when none). Raises when a setting the checkpoint is
    made of changed, or a hyper-parameter did without --resume-with-new-hparams."""
    fixed = _changes(saved, config, FIXED_BY_CHECKPOINT)
    if fixed:
        raise ValueError(
            f"the checkpoint of step {step} ({where}) was trained with other settings "
            f"({_listed(fixed)}), and a resumed run cannot change them: its data position and "
            f"optimizer state are made of them. Resume with the checkpoint's ({_flags(fixed)}), "
            f"or start a new run from its weights: --init-from {shlex.quote(where)} and another "
            "--checkpoint-dir"
        )
    decaying = any(
        s in DECAYING_SCHEDULES
        for s in (saved.get("lr_schedule"), config.learning_rate.lr_schedule)
    )
    names = (*NEW_WITH_FLAG, "steps") if decaying else NEW_WITH_FLAG
    changes = _changes(saved, config, names)
    if not changes or config.checkpoint.resume_with_new_hparams:
        return _listed(changes)
    if set(changes) == {"steps"} and step >= changes["steps"][0]:
        raise ValueError(
            f"the checkpoint's run is finished (step {step} of --steps {changes['steps'][0]}) "
            f"and its learning rate decays to its end ({saved.get('lr_schedule')}): to train "
            f"on to --steps {config.run.steps}, add --resume-with-new-hparams, which continues the "
            "schedule over the new --steps from this step"
        )
    raise ValueError(
        f"the checkpoint of step {step} was trained with other settings ({_listed(changes)}): "
        f"resume with the checkpoint's ({_flags(changes)}), or add --resume-with-new-hparams to "
        "continue with the new ones from this step"
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
