"""`"auto"` in a DeepSpeed config, filled in from the run's flags as the Hugging Face
Trainer fills it from its TrainingArguments (`HfTrainerDeepSpeedConfig.trainer_config_process`).

The Trainer writes its own batch size, accumulation, clipping, optimizer hyper-parameters,
warmup and total steps and precision into the keys a config marks "auto"; meshpipe does the
same with its flags (their defaults where not given). ZeRO's bucket sizes, which the Trainer
derives from the hidden size, are communication settings meshpipe accepts as they are. Any
other "auto" has no flag to come from and is refused by name.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping
from typing import Any

from engine.config import require

__all__ = ["AUTO_COMMUNICATION_KEYS", "AUTO_FILLED", "resolve_auto"]

AUTO_FILLED = (
    "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
    "gradient_clipping", "optimizer.params.lr", "optimizer.params.betas",
    "optimizer.params.eps", "optimizer.params.weight_decay", "scheduler.params.warmup_min_lr",
    "scheduler.params.warmup_max_lr", "scheduler.params.warmup_num_steps",
    "scheduler.params.total_num_steps", "fp16.enabled", "bf16.enabled",
)  # fmt: skip
"""The keys an "auto" may mark: those the Trainer fills from its arguments."""

AUTO_COMMUNICATION_KEYS = (
    "zero_optimization.reduce_bucket_size",
    "zero_optimization.stage3_prefetch_bucket_size",
    "zero_optimization.stage3_param_persistence_threshold",
)
"""The Trainer's "auto" ZeRO bucket sizes: they only group communication, so any value does."""


def _micro_batch_size(flags: Mapping[str, Any], dp: int) -> int:
    total, micro_batches = int(flags["global_batch"]), int(flags["micro_batches"])
    require(
        total % (dp * micro_batches) == 0,
        f'train_micro_batch_size_per_gpu="auto": --global-batch {total} does not split into '
        f"--micro-batches {micro_batches} on each of {dp} replica(s): give a multiple of "
        f"{dp * micro_batches}, or write the value",
    )
    return total // (dp * micro_batches)


def _betas(text: Any) -> list[float]:
    return [float(b) for b in str(text).split(",")] if isinstance(text, str) else list(text)


def _fillers(flags: Mapping[str, Any], dp: int) -> dict[str, Any]:
    """Each key the Trainer fills, and the value meshpipe's flags give it (a callable when
    it can fail, so only a key marked "auto" asks)."""
    return {
        "train_batch_size": flags["global_batch"],
        "train_micro_batch_size_per_gpu": lambda: _micro_batch_size(flags, dp),
        "gradient_accumulation_steps": flags["micro_batches"],
        "gradient_clipping": flags["clip_grad_norm"],
        "optimizer.params.lr": flags["lr"],
        "optimizer.params.betas": lambda: _betas(flags["betas"]),
        "optimizer.params.eps": flags["adam_eps"],
        "optimizer.params.weight_decay": flags["weight_decay"],
        "scheduler.params.warmup_min_lr": 0,
        "scheduler.params.warmup_max_lr": flags["lr"],
        "scheduler.params.warmup_num_steps": flags["warmup_steps"],
        "scheduler.params.total_num_steps": flags["steps"],
        "fp16.enabled": flags["precision"] == "fp16",
        "bf16.enabled": flags["precision"] == "bf16",
    }


def _autos(value: Any, path: str = "") -> Iterator[str]:
    """The dotted paths of every "auto" in a parsed config."""
    if isinstance(value, Mapping):
        for key, inner in value.items():
            yield from _autos(inner, f"{path}.{key}" if path else str(key))
    elif value == "auto":
        yield path


def _set(config: dict[str, Any], path: str, value: Any) -> None:
    *parents, last = path.split(".")
    for key in parents:
        config = config[key]
    config[last] = value


def resolve_auto(
    config: Mapping[str, Any], flags: Mapping[str, Any] | None, *, dp: int
) -> dict[str, Any]:
    """A copy of `config` with every "auto" the Trainer would fill taken from `flags` (flat
    settings: the given flags over meshpipe's defaults); ZeRO's "auto" bucket sizes stay.
    Without `flags`, or for a key the Trainer does not fill, an "auto" is refused by name."""
    resolved = copy.deepcopy(dict(config))
    autos = [p for p in _autos(resolved) if p not in AUTO_COMMUNICATION_KEYS]
    if not autos:
        return resolved
    unknown = [p for p in autos if p not in AUTO_FILLED]
    require(
        not unknown,
        f'DeepSpeed config {", ".join(unknown)}="auto": meshpipe fills "auto" from its flags '
        f"only where the Hugging Face Trainer would ({', '.join(AUTO_FILLED)}); write "
        "the value",
    )
    require(
        flags is not None,
        f'DeepSpeed config {", ".join(autos)}="auto": "auto" is filled from the run\'s flags '
        "(meshpipe train --deepspeed_config, or TrainConfig.from_deepspeed); write the value",
    )
    assert flags is not None
    fillers = _fillers(flags, dp)
    for path in autos:
        filler = fillers[path]
        _set(resolved, path, filler() if callable(filler) else filler)
    return resolved
