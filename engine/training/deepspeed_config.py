"""DeepSpeed JSON configs: the keys that apply to meshpipe, checked the way DeepSpeed checks them.

A training script written for DeepSpeed's launcher passes `--deepspeed_config ds.json`;
`from_deepspeed` turns the file into `TrainConfig` fields. Keys meshpipe does not support are
rejected by name instead of silently ignored.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from engine.config.engine_options import ZERO_LEVELS
from engine.config.optimizer import check_scheduler_params, no_auto

__all__ = [
    "deepspeed_defaults",
    "deepspeed_overrides",
    "read_deepspeed_config",
]

_IGNORED = {"wall_clock_breakdown", "steps_per_print", "prescale_gradients"}
_OPTIMIZERS = {"adam": "adamw", "adamw": "adamw", "sgd": "sgd"}
_OPTIMIZER_PARAMS = {
    "adamw": ("lr", "betas", "eps", "weight_decay", "adam_w_mode", "torch_adam"),
    "sgd": ("lr", "momentum", "weight_decay"),
}
"""The DeepSpeed optimizer params meshpipe honours (torch_adam only picks DeepSpeed's kernel)."""
_OPTIMIZER_DEFAULTS: dict[str, dict[str, Any]] = {
    "adamw": {"lr": 1e-3, "betas": "0.9,0.999", "adam_eps": 1e-8, "weight_decay": 0.0},
    "sgd": {"lr": 1e-3, "momentum": 0.0, "weight_decay": 0.0},
}
"""What DeepSpeed's optimizers use for a param the config omits: its Adam kernels' (FusedAdam,
DeepSpeedCPUAdam) defaults, and torch.optim.SGD's."""
_TORCH_ADAMW_WEIGHT_DECAY = 0.01
"""torch.optim.AdamW's default weight decay, which `torch_adam: true` makes DeepSpeed build."""


DEEPSPEED_DEFAULT_CLIPPING = 1.0
"""DeepSpeed's GRADIENT_CLIPPING_DEFAULT: what it clips at when a config says nothing."""


def _number(value: Any, key: str, kind: type[float] | type[int] = float) -> Any:
    """`value` as a float (or int), or an error naming the key."""
    no_auto(value, key)
    try:
        number = kind(value)
    except (TypeError, ValueError):
        number = None
    if number is None or isinstance(value, bool) or (kind is int and number != value):
        noun = "a whole number" if kind is int else "a number"
        raise ValueError(f"{key}={value!r}: give {noun}")
    return number


def _batch_fields(cfg: Mapping[str, Any], dp: int) -> dict[str, int]:
    """train_batch_size = micro × accumulation × dp, completed the way DeepSpeed's
    `_set_batch_related_parameters` does: any two determine the third, and one batch size
    alone means no gradient accumulation."""
    names = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    for name in names:
        no_auto(cfg.get(name), name)
        if name in cfg and not (isinstance(cfg[name], int) and cfg[name] >= 1):
            raise ValueError(f"{name}={cfg[name]!r}: give a whole number of at least 1")
    total: int | None = cfg.get(names[0])
    micro: int | None = cfg.get(names[1])
    accumulation: int | None = cfg.get(names[2])
    if total is not None and micro is not None:
        accumulation = total // (micro * dp) if accumulation is None else accumulation
    elif total is not None:
        accumulation = 1 if accumulation is None else accumulation
        micro = total // (accumulation * dp)
    elif micro is not None:
        accumulation = 1 if accumulation is None else accumulation
        total = micro * accumulation * dp
    else:
        raise ValueError(
            "the DeepSpeed config sets neither train_batch_size nor "
            "train_micro_batch_size_per_gpu: add at least one of them"
        )
    if total != micro * accumulation * dp:
        raise ValueError(
            f"train_batch_size {total} != train_micro_batch_size_per_gpu {micro} × "
            f"gradient_accumulation_steps {accumulation} × data-parallel size {dp}: "
            "make them consistent, as DeepSpeed requires"
        )
    return {"global_batch": total, "micro_batches": accumulation}


def _optimizer_fields(section: Mapping[str, Any]) -> dict[str, Any]:
    """Optimizer fields; a param meshpipe's optimizer would not honour is rejected by name."""
    kind = str(section.get("type", "")).lower()
    if kind not in _OPTIMIZERS:
        raise ValueError(
            f"optimizer type {section.get('type')!r} is not supported: use Adam, AdamW or SGD"
        )
    params = dict(section.get("params", {}))
    accepted = _OPTIMIZER_PARAMS[_OPTIMIZERS[kind]]
    unknown = sorted(set(params) - set(accepted))
    if unknown:
        raise ValueError(
            f"optimizer {section['type']} params {unknown} are not supported by meshpipe: "
            f"remove them (supported: {', '.join(accepted)})"
        )
    if kind == "adam" and not params.get("adam_w_mode", True):
        raise ValueError(
            "optimizer Adam with adam_w_mode false (Adam with L2 regularisation) is not "
            "supported: meshpipe's Adam is AdamW, decoupled weight decay; remove adam_w_mode "
            "(the same update when weight_decay is 0) or use type AdamW"
        )
    fields: dict[str, Any] = {"optimizer": _OPTIMIZERS[kind]}
    if "lr" in params:
        fields["lr"] = _number(params["lr"], "optimizer.params.lr")
    if "weight_decay" in params:
        fields["weight_decay"] = _number(params["weight_decay"], "optimizer.params.weight_decay")
    if "betas" in params:
        fields["betas"] = _betas(params["betas"])
    if "eps" in params:
        fields["adam_eps"] = _number(params["eps"], "optimizer.params.eps")
    if "momentum" in params:
        fields["momentum"] = _number(params["momentum"], "optimizer.params.momentum")
    return fields


def _betas(value: Any) -> tuple[float, float]:
    no_auto(value, "optimizer.params.betas")
    if not isinstance(value, list | tuple) or len(value) != 2:
        raise ValueError(f"optimizer.params.betas={value!r}: give two numbers, e.g. [0.9, 0.999]")
    first, second = (_number(b, "optimizer.params.betas") for b in value)
    return first, second


def _scheduler_fields(section: Mapping[str, Any]) -> dict[str, Any]:
    kind = section.get("type")
    params = dict(section.get("params", {}))
    check_scheduler_params(str(kind), params)
    return {"lr_schedule": f"deepspeed:{kind}", "lr_schedule_args": json.dumps(params)}


def _precision_fields(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """A config naming neither bf16 nor fp16 leaves --precision; one naming either decides
    (fp32 when neither is enabled), as DeepSpeed would run it."""
    if "bf16" not in cfg and "fp16" not in cfg:
        return {}
    bf16 = bool(cfg.get("bf16", {}).get("enabled", False))
    fp16 = bool(cfg.get("fp16", {}).get("enabled", False))
    if bf16 and fp16:
        raise ValueError("the DeepSpeed config enables both bf16 and fp16: choose one")
    return {"precision": "bf16" if bf16 else "fp16" if fp16 else "fp32"}


def _recompute_fields(section: Mapping[str, Any]) -> dict[str, Any]:
    unsupported = [
        k
        for k in ("partition_activations", "cpu_checkpointing", "contiguous_memory_optimization")
        if section.get(k)
    ]
    if unsupported:
        raise ValueError(f"activation_checkpointing options {unsupported} are not supported")
    return {"recompute": "every:1"}


def read_deepspeed_config(config: str | Path | Mapping[str, Any]) -> dict[str, Any]:
    """A DeepSpeed config as a dict, from its JSON file's path or already parsed."""
    if isinstance(config, Mapping):
        return dict(config)
    path = Path(config)
    try:
        parsed = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"DeepSpeed config {path} does not exist: check the path") from None
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(f"cannot read DeepSpeed config {path}: {error}") from None
    except json.JSONDecodeError as error:
        raise ValueError(f"DeepSpeed config {path} is not valid JSON: {error}") from None
    if not isinstance(parsed, dict):
        raise ValueError(f"DeepSpeed config {path} holds a {type(parsed).__name__}, not an object")
    return parsed


def deepspeed_defaults(config: str | Path | Mapping[str, Any]) -> dict[str, Any]:
    """`TrainConfig` fields DeepSpeed would use where the config says nothing: clipping at
    1.0 and, when the config names an optimizer (so DeepSpeed builds it), that optimizer's own
    defaults (betas 0.9,0.999 and no weight decay for Adam, not meshpipe's 0.9,0.95 and 0.1)
    and, without a scheduler, its constant learning rate."""
    cfg = read_deepspeed_config(config)
    defaults: dict[str, Any] = {"clip_grad_norm": DEEPSPEED_DEFAULT_CLIPPING}
    if "optimizer" in cfg:
        section = cfg["optimizer"]
        name = _OPTIMIZERS.get(str(section.get("type", "")).lower(), "adamw")
        defaults.update(_OPTIMIZER_DEFAULTS[name])
        if name == "adamw" and section.get("params", {}).get("torch_adam", False):
            defaults["weight_decay"] = _TORCH_ADAMW_WEIGHT_DECAY
        if "scheduler" not in cfg:
            defaults.update(lr_schedule="constant", warmup_steps=0)
    return defaults


def deepspeed_overrides(config: str | Path | Mapping[str, Any], *, dp: int) -> dict[str, Any]:
    """`TrainConfig` fields from the keys a DeepSpeed config (a path or a parsed dict) has;
    `deepspeed_defaults` gives what DeepSpeed would use for the keys it omits."""
    cfg = read_deepspeed_config(config)
    fields: dict[str, Any] = _batch_fields(cfg, dp)
    handlers = {
        "optimizer": _optimizer_fields,
        "scheduler": _scheduler_fields,
        "activation_checkpointing": _recompute_fields,
    }
    for key, handler in handlers.items():
        if key in cfg:
            fields.update(handler(cfg[key]))
    fields.update(_precision_fields(cfg))
    if "gradient_clipping" in cfg:
        fields["clip_grad_norm"] = _number(cfg["gradient_clipping"], "gradient_clipping")
    if "seed" in cfg:
        fields["seed"] = _number(cfg["seed"], "seed", int)
    if "zero_optimization" in cfg:
        stage = _number(cfg["zero_optimization"].get("stage", 0), "zero_optimization.stage", int)
        if stage not in ZERO_LEVELS:
            levels = ", ".join(map(str, ZERO_LEVELS))
            raise ValueError(
                f"zero_optimization.stage={stage}: meshpipe supports ZeRO stages {levels}"
            )
        fields["zero"] = stage
    if "partition_method" in cfg.get("pipeline", {}):
        fields["partition"] = str(cfg["pipeline"]["partition_method"])
    known = {
        "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
        "optimizer", "scheduler", "gradient_clipping", "bf16", "fp16", "zero_optimization",
        "pipeline", "activation_checkpointing", "seed", *_IGNORED,
    }  # fmt: skip
    unknown = sorted(set(cfg) - known)
    if unknown:
        raise ValueError(
            f"DeepSpeed config keys {unknown} are not supported by meshpipe: remove them "
            f"(supported: {', '.join(sorted(known))})"
        )
    return fields
