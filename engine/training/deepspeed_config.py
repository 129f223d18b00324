"""DeepSpeed JSON configs read as DeepSpeed runs them: every top-level key DeepSpeed accepts
is honoured with its meaning or refused naming the key and why.

A training script written for DeepSpeed's launcher passes `--deepspeed_config ds.json`;
`deepspeed_overrides` turns the file into flat `TrainConfig` settings and
`deepspeed_defaults` gives DeepSpeed's defaults for what it omits. `TOP_LEVEL_KEYS` is the
one table of every top-level key and its fate (docs/DEEPSPEED.md shows it); the sections are
read by `engine.training.deepspeed_sections` (training) and
`engine.training.deepspeed_monitors` (what a run reports), "auto" values by
`engine.training.deepspeed_auto`. A key DeepSpeed does not know is refused by name.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from engine.config import LOSS_SCALE_FIELDS, require
from engine.config.optimizer import no_auto
from engine.training.deepspeed_auto import resolve_auto
from engine.training.deepspeed_monitors import MONITOR_HANDLERS, check_recompute_fwd_factor
from engine.training.deepspeed_sections import (
    SECTION_HANDLERS,
    Refusals,
    precision,
    zero_stage,
)

__all__ = [
    "DEEPSPEED_DEFAULT_CLIPPING",
    "TOP_LEVEL_KEYS",
    "check_agreement",
    "deepspeed_defaults",
    "deepspeed_overrides",
    "read_deepspeed_config",
]

DEEPSPEED_DEFAULT_CLIPPING = 1.0
"""DeepSpeed's GRADIENT_CLIPPING_DEFAULT: what it clips at when a config says nothing."""
DEEPSPEED_STEPS_PER_PRINT = 10
"""DeepSpeed's STEPS_PER_PRINT_DEFAULT: it logs every 10 steps unless told otherwise."""
_DEEPSPEED_LOSS_SCALING = {"initial_scale_power": 16, "loss_scale_window": 1000}
"""DeepSpeed's dynamic loss scale where a config enables fp16 through a flag only."""

_BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
_OFF = object()
"""A section DeepSpeed leaves off unless its `enabled` is true."""
_REFUSED: Refusals = {
    "amp": (_OFF, "NVIDIA Apex AMP is not supported: use bf16 or fp16 (autocast)"),
    "comms_logger": (_OFF, "meshpipe has no per-collective log: --trace FILE records every "
                           "p2p and all-reduce on the timeline"),
    "comet": (_OFF, "Comet logging is not implemented: use tensorboard, csv_monitor or wandb"),
    "elasticity": (_OFF, "elastic batch sizes are not implemented"),
    "autotuning": (_OFF, "use `meshpipe plan` to search layouts"),
    "curriculum_learning": (_OFF, "curriculum learning changes the data order"),
    "data_efficiency": (_OFF, "data sampling and routing change the data order"),
    "eigenvalue": (_OFF, "not implemented"),
    "progressive_layer_drop": (_OFF, "dropping layers changes the numbers"),
    "hybrid_engine": (_OFF, "the RLHF hybrid engine is not implemented"),
    "torch_autocast": (_OFF, "use bf16 or fp16, which autocast in meshpipe"),
    "nebula": (_OFF, "meshpipe writes its own checkpoints"),
    "quantize_training": (_OFF, "quantised training changes the numbers"),
    "datastates_ckpt": (_OFF, "meshpipe writes its own checkpoints"),
    "compression_training": ({}, "compression changes the numbers"),
    "sparse_attention": ({}, "sparse attention changes the numbers"),
    "weight_quantization": ({}, "quantised weights change the numbers"),
    "compile": ({}, "use --compile (torch.compile per layer)"),
    "tensor_parallel": ({}, "use --tp"),
    "expert_parallel": ({}, "meshpipe's models have no experts"),
    "aio": ({}, "async I/O only serves NVMe offload, which is not implemented"),
    "timers": ({}, "DeepSpeed's timer switches: use --log-phases or --trace"),
    "sequence_parallel_size": (1, "sequence parallelism is not implemented"),
    "gradient_predivide_factor": (1.0, "meshpipe averages gradients without a pre-divide"),
    "gradient_allreduce_op": ("mean", "meshpipe averages gradients over replicas"),
    "communication_data_type": (None, "meshpipe reduces gradients in fp32"),
    "seq_parallel_communication_data_type": ("fp32", "sequence parallelism is not implemented"),
    "sparse_gradients": (False, "meshpipe's gradients are dense"),
    "disable_allgather": (False, "ZeRO's all-gather is how the shards come back"),
    "dump_state": (False, "use --trace or meshpipe memory"),
    "memory_breakdown": (False, "use `meshpipe memory` for per-stage memory"),
    "dataloader_drop_last": (False, "meshpipe's data loader is its own"),
    "managed_gradient_accumulation": (True, "meshpipe accumulates over its micro-batches"),
    "use_data_before_expert_parallelism": (False, "meshpipe's models have no experts"),
    "graph_harvesting": (False, "removed from DeepSpeed"),
    "bfloat16": (_OFF, "the old name of bf16: write bf16"),
}  # fmt: skip
"""Top-level keys refused unless at DeepSpeed's off value (or a section not enabled)."""
_ACCEPTED = {
    "prescale_gradients": "the order of the data-parallel mean; meshpipe reduces in fp32",
    "zero_allow_untested_optimizer": "a permission: meshpipe's optimizers all run under ZeRO",
    "zero_force_ds_cpu_optimizer": "only applies with offload, which is refused",
    "log_level": "DeepSpeed's own logging",
    "disable_python_gc": "garbage-collection timing only",
    "vocabulary_size": "only read by DeepSpeed's data-efficiency library",
}
"""Top-level keys accepted with any value: nothing meshpipe computes depends on them."""
_HONOURED = {
    "train_batch_size": "--global-batch",
    "train_micro_batch_size_per_gpu": "--global-batch / (--dp × --micro-batches)",
    "gradient_accumulation_steps": "--micro-batches",
    "optimizer": "--optimizer, --lr, --betas, --adam-eps, --weight-decay, --momentum",
    "scheduler": "--lr-schedule deepspeed:<type>, --lr-schedule-args",
    "gradient_clipping": "--clip-grad-norm",
    "fp16": "--precision fp16 and its loss-scale flags",
    "bf16": "--precision bf16; check_grad_overflow: --no-nonfinite-guard",
    "zero_optimization": "--zero (communication keys accepted, offload refused)",
    "activation_checkpointing": "nothing (it recomputes nothing by itself)",
    "pipeline": "--partition (partition_method), --recompute every:N "
                "(activation_checkpoint_interval)",
    "seed": "--seed",
    "steps_per_print": "--log-every",
    "wall_clock_breakdown": "--log-phases",
    "tensorboard": "--tensorboard-dir (output_path/job_name)",
    "csv_monitor": "--csv-dir (output_path/job_name)",
    "wandb": "--wandb-project, --wandb-group (offline)",
    "flops_profiler": "--flops-profile-step (profile_step + 1), --flops-profile-file "
                      "(output_file); recompute_fwd_factor checked against --recompute",
    "data_types": "grad_accum_dtype fp32 only",
    "checkpoint": "tag_validation accepted; other keys refused",
}  # fmt: skip
TOP_LEVEL_KEYS: dict[str, str] = {
    **{key: f"honoured: {fate}" for key, fate in _HONOURED.items()},
    **{key: f"accepted: {why}" for key, why in _ACCEPTED.items()},
    **{
        key: ("off only" if off is _OFF else f"{json.dumps(off)} only") + f": {why}"
        for key, (off, why) in _REFUSED.items()
    },
}
"""Every top-level key DeepSpeed reads, and what meshpipe does with it."""
_SOURCES = {
    "global_batch": "train_batch_size", "micro_batches": "gradient_accumulation_steps",
    "optimizer": "optimizer.type", "lr": "optimizer.params.lr",
    "weight_decay": "optimizer.params.weight_decay", "betas": "optimizer.params.betas",
    "adam_eps": "optimizer.params.eps", "momentum": "optimizer.params.momentum",
    "lr_schedule": "scheduler.type", "lr_schedule_args": "scheduler.params",
    "precision": "fp16/bf16 enabled", "no_nonfinite_guard": "bf16.check_grad_overflow",
    "clip_grad_norm": "gradient_clipping", "seed": "seed", "zero": "zero_optimization.stage",
    "partition": "pipeline.partition_method",
    "recompute": "pipeline.activation_checkpoint_interval", "log_every": "steps_per_print",
    "log_phases": "wall_clock_breakdown", "tensorboard_dir": "tensorboard",
    "csv_dir": "csv_monitor", "wandb_project": "wandb.project", "wandb_group": "wandb.group",
    "flops_profile_step": "flops_profiler.profile_step + 1 =",
    "flops_profile_file": "flops_profiler.output_file",
    **{name: f"fp16.{name}" for name in LOSS_SCALE_FIELDS},
}  # fmt: skip
"""The JSON key each flat setting comes from, to name both sides of a contradiction."""


def _batch_fields(cfg: Mapping[str, Any], dp: int) -> dict[str, int]:
    """train_batch_size = micro × accumulation × dp, completed the way DeepSpeed's
    `_set_batch_related_parameters` does: any two determine the third, and one batch size
    alone means no gradient accumulation."""
    for name in _BATCH_KEYS:
        no_auto(cfg.get(name), name)
        if name in cfg and not (isinstance(cfg[name], int) and cfg[name] >= 1):
            raise ValueError(f"{name}={cfg[name]!r}: give a whole number of at least 1")
    total: int | None = cfg.get(_BATCH_KEYS[0])
    micro: int | None = cfg.get(_BATCH_KEYS[1])
    accumulation: int | None = cfg.get(_BATCH_KEYS[2])
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
    require(
        total == micro * accumulation * dp,
        f"train_batch_size {total} != train_micro_batch_size_per_gpu {micro} × "
        f"gradient_accumulation_steps {accumulation} × data-parallel size {dp}: "
        "make them consistent, as DeepSpeed requires",
    )
    return {"global_batch": total, "micro_batches": accumulation}


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


def _check_keys(cfg: Mapping[str, Any]) -> None:
    """Unknown top-level keys, then keys set to what meshpipe cannot honour, by name."""
    unknown = sorted(set(cfg) - set(TOP_LEVEL_KEYS))
    require(
        not unknown,
        f"DeepSpeed config keys {unknown} are not supported by meshpipe (DeepSpeed 0.19 does "
        "not read them either): remove them (docs/DEEPSPEED.md lists every key and its fate)",
    )
    for key, (off, why) in _REFUSED.items():
        if key not in cfg:
            continue
        value = cfg[key]
        if off is _OFF:
            inert = isinstance(value, Mapping) and not value.get("enabled", False)
        else:
            inert = value == off
        only = '{"enabled": false}' if off is _OFF else json.dumps(off)
        require(
            inert,
            f"DeepSpeed config {key}={json.dumps(value)} is refused: {why} (meshpipe accepts "
            f"{key} only as {only})",
        )


def deepspeed_overrides(
    config: str | Path | Mapping[str, Any],
    *,
    dp: int,
    flags: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Flat `TrainConfig` settings from the keys a DeepSpeed config (a path or a parsed
    dict) has; `flags` (flat settings: the flags given over meshpipe's defaults) fill its
    "auto" values. `deepspeed_defaults` gives what DeepSpeed uses for the keys it omits."""
    cfg = resolve_auto(read_deepspeed_config(config), flags, dp=dp)
    _check_keys(cfg)
    fields: dict[str, Any] = _batch_fields(cfg, dp)
    for key, handler in {**SECTION_HANDLERS, **MONITOR_HANDLERS}.items():
        if key in cfg:
            fields.update(handler(cfg[key], cfg))
    fields.update(precision(cfg))
    check_recompute_fwd_factor(cfg, {**(flags or {}), **fields})
    return fields


def deepspeed_defaults(
    config: str | Path | Mapping[str, Any], *, precision: str = "fp32"
) -> dict[str, Any]:
    """Flat settings DeepSpeed would use where the config says nothing: clipping at 1.0, a log
    line every 10 steps; when the config names an optimizer (so DeepSpeed builds it), that
    optimizer's own defaults (betas 0.9,0.999 and no weight decay for Adam, not meshpipe's
    0.9,0.95 and 0.1) and, without a scheduler, its constant learning rate; ZeRO-3's
    per-tensor optimizer; and DeepSpeed's dynamic loss scale when the run's `precision` is
    fp16 by a flag."""
    cfg = read_deepspeed_config(config)
    defaults: dict[str, Any] = {
        "clip_grad_norm": DEEPSPEED_DEFAULT_CLIPPING,
        "log_every": DEEPSPEED_STEPS_PER_PRINT,
    }
    if "optimizer" in cfg:
        defaults.update(_optimizer_defaults(cfg))
    if "zero_optimization" in cfg and zero_stage(cfg) == 3:
        defaults["optimizer_impl"] = "per_tensor"
    if precision == "fp16" and not cfg.get("fp16", {}).get("enabled", False):
        hysteresis = 2 if zero_stage(cfg) > 0 else 1
        defaults.update(_DEEPSPEED_LOSS_SCALING, hysteresis=hysteresis)
    return defaults


def _optimizer_defaults(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """What DeepSpeed's optimizers use for a param the config omits: its Adam kernels'
    (FusedAdam, DeepSpeedCPUAdam) defaults, torch.optim.AdamW's decay of 0.01 under
    `torch_adam`, and torch.optim.SGD's."""
    section = cfg["optimizer"]
    if str(section.get("type", "")).lower() == "sgd":
        defaults: dict[str, Any] = {"lr": 1e-3, "momentum": 0.0, "weight_decay": 0.0}
    else:
        defaults = {"lr": 1e-3, "betas": "0.9,0.999", "adam_eps": 1e-8, "weight_decay": 0.0}
        if section.get("params", {}).get("torch_adam", False):
            defaults["weight_decay"] = 0.01
    if "scheduler" not in cfg:
        defaults.update(lr_schedule="constant", warmup_steps=0)
    return defaults


def check_agreement(
    given: Mapping[str, Any],
    overrides: Mapping[str, Any],
    source: str,
    normalise: Callable[[str, Any], Any],
) -> None:
    """Refuse a flag given on the command line that the JSON sets otherwise, naming both;
    `normalise(name, value)` puts a value in its field's form (betas "0.9,0.95" or a pair)."""
    for name, value in overrides.items():
        if name in given and normalise(name, given[name]) != normalise(name, value):
            flag = "--" + name.replace("_", "-")
            key = _SOURCES.get(name, name)
            raise ValueError(
                f"{flag} {given[name]} contradicts {key} {json.dumps(value)} in {source}: drop one"
            )
