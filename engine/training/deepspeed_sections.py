"""The sections of a DeepSpeed config, each read with DeepSpeed's meaning into flat
`TrainConfig` settings, or refused naming the key and why (`engine.training.deepspeed_config`
holds the table of top-level keys and calls these handlers).

A handler takes its section and the whole config (fp16's hysteresis depends on ZeRO) and
returns flat settings; a key it does not know is refused by name, a key whose value meshpipe
cannot honour is refused with the reason, and a key that changes nothing meshpipe computes
(communication bucketing, DeepSpeed's own logging switches) is accepted as it is.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

from engine.config import LOSS_SCALE_FIELDS, ZERO_LEVELS, require
from engine.config.optimizer import check_scheduler_params, no_auto

__all__ = [
    "SECTION_HANDLERS",
    "Handler",
    "Refusals",
    "check_known",
    "number",
    "precision",
    "refuse_values",
    "section_of",
    "zero_stage",
]

Handler = Callable[[Any, Mapping[str, Any]], dict[str, Any]]
Refusals = Mapping[str, tuple[Any, str]]
"""Sub-key -> (the value DeepSpeed treats as off, why meshpipe refuses any other)."""

_OPTIMIZERS = {"adam": "adamw", "adamw": "adamw", "sgd": "sgd"}
_OPTIMIZER_PARAMS = {
    "adamw": ("lr", "betas", "eps", "weight_decay", "adam_w_mode", "torch_adam"),
    "sgd": ("lr", "momentum", "weight_decay"),
}
"""The DeepSpeed optimizer params meshpipe honours (torch_adam only picks DeepSpeed's kernel)."""


def number(value: Any, key: str, kind: type[float] | type[int] = float) -> Any:
    """`value` as a float (or int), or an error naming the key."""
    no_auto(value, key)
    try:
        result = kind(value)
    except (TypeError, ValueError):
        result = None
    if result is None or isinstance(value, bool) or (kind is int and result != value):
        noun = "a whole number" if kind is int else "a number"
        raise ValueError(f"{key}={value!r}: give {noun}")
    return result


def section_of(value: Any, key: str) -> Mapping[str, Any]:
    require(isinstance(value, Mapping), f"DeepSpeed config {key}={value!r}: give an object")
    result: Mapping[str, Any] = value
    return result


def check_known(section: Mapping[str, Any], accepted: tuple[str, ...], key: str) -> None:
    unknown = sorted(set(section) - set(accepted))
    require(
        not unknown,
        f"DeepSpeed config {key} keys {unknown} are not DeepSpeed's (or not supported by "
        f"meshpipe): remove them (accepted: {', '.join(accepted)})",
    )


def refuse_values(section: Mapping[str, Any], refusals: Refusals, key: str) -> None:
    """Refuse, by name and with the reason, each sub-key set to other than its off value."""
    for name, (off, reason) in refusals.items():
        if name in section and section[name] != off:
            raise ValueError(f"DeepSpeed config {key}.{name}={section[name]!r}: {reason}")


def _optimizer(value: Any, config: Mapping[str, Any]) -> dict[str, Any]:
    """Optimizer fields; a param meshpipe's optimizer would not honour is rejected by name."""
    section = section_of(value, "optimizer")
    kind = str(section.get("type", "")).lower()
    require(
        kind in _OPTIMIZERS,
        f"optimizer type {section.get('type')!r} is not supported: use Adam, AdamW or SGD",
    )
    params = dict(section.get("params", {}))
    accepted = _OPTIMIZER_PARAMS[_OPTIMIZERS[kind]]
    unknown = sorted(set(params) - set(accepted))
    require(
        not unknown,
        f"optimizer {section['type']} params {unknown} are not supported by meshpipe: "
        f"remove them (supported: {', '.join(accepted)})",
    )
    require(
        kind != "adam" or params.get("adam_w_mode", True),
        "optimizer Adam with adam_w_mode false (Adam with L2 regularisation) is not "
        "supported: meshpipe's Adam is AdamW, decoupled weight decay; remove adam_w_mode "
        "(the same update when weight_decay is 0) or use type AdamW",
    )
    fields: dict[str, Any] = {"optimizer": _OPTIMIZERS[kind]}
    names = {"lr": "lr", "weight_decay": "weight_decay", "eps": "adam_eps", "momentum": "momentum"}
    for param, name in names.items():
        if param in params:
            fields[name] = number(params[param], f"optimizer.params.{param}")
    if "betas" in params:
        fields["betas"] = _betas(params["betas"])
    return fields


def _betas(value: Any) -> tuple[float, float]:
    no_auto(value, "optimizer.params.betas")
    require(
        isinstance(value, list | tuple) and len(value) == 2,
        f"optimizer.params.betas={value!r}: give two numbers, e.g. [0.9, 0.999]",
    )
    first, second = (number(b, "optimizer.params.betas") for b in value)
    return first, second


def _scheduler(value: Any, config: Mapping[str, Any]) -> dict[str, Any]:
    section = section_of(value, "scheduler")
    kind = section.get("type")
    params = dict(section.get("params", {}))
    check_scheduler_params(str(kind), params)
    return {"lr_schedule": f"deepspeed:{kind}", "lr_schedule_args": json.dumps(params)}


_FP16_KEYS = ("enabled", "auto_cast", *LOSS_SCALE_FIELDS, "fp16_master_weights_and_grads")
_FP16_DEFAULTS: dict[str, Any] = {
    "loss_scale": 0.0,
    "initial_scale_power": 16,
    "loss_scale_window": 1000,
    "hysteresis": 2,
    "consecutive_hysteresis": False,
    "min_loss_scale": 1.0,
}
"""DeepSpeedFP16Config's defaults: a dynamic scale from 2^16, doubling every 1000 steps."""
_FP16_REFUSED: Refusals = {
    "fp16_master_weights_and_grads": (
        False,
        "meshpipe keeps fp32 master weights and gradients: remove it",
    ),
}


def zero_stage(config: Mapping[str, Any]) -> int:
    """The ZeRO stage a config asks for (0 without a zero_optimization section)."""
    section = section_of(config.get("zero_optimization", {}), "zero_optimization")
    stage: int = number(section.get("stage", 0), "zero_optimization.stage", int)
    return stage


def _fp16(value: Any, config: Mapping[str, Any]) -> dict[str, Any]:
    """fp16's loss scaling as DeepSpeed runs it: its ZeRO optimizers honour the hysteresis,
    its fp16 optimizer without ZeRO ignores it (halving on every overflow). A disabled
    section is ignored, as DeepSpeed ignores it."""
    section = section_of(value, "fp16")
    check_known(section, _FP16_KEYS, "fp16")
    if not section.get("enabled", False):
        return {}
    refuse_values(section, _FP16_REFUSED, "fp16")
    fields: dict[str, Any] = {}
    for name, default in _FP16_DEFAULTS.items():
        given = section.get(name, default)
        if isinstance(default, bool):
            fields[name] = bool(given)
        else:
            fields[name] = number(given, f"fp16.{name}", type(default))
    if zero_stage(config) == 0:
        fields["hysteresis"], fields["consecutive_hysteresis"] = 1, False
    return fields


_BF16_KEYS = ("enabled", "immediate_grad_update", "check_grad_overflow",
              "bf16_master_weights_and_grads", "bf16_optimizer_states")  # fmt: skip
_BF16_REFUSED: Refusals = {
    "immediate_grad_update": (False, "meshpipe applies gradients after the whole step"),
    "bf16_master_weights_and_grads": (False, "meshpipe keeps fp32 masters and gradients"),
    "bf16_optimizer_states": (False, "meshpipe keeps the optimizer state in fp32"),
}


def _bf16(value: Any, config: Mapping[str, Any]) -> dict[str, Any]:
    """bf16: check_grad_overflow is meshpipe's non-finite guard (on by default in both)."""
    section = section_of(value, "bf16")
    check_known(section, _BF16_KEYS, "bf16")
    if not section.get("enabled", False):
        return {}
    refuse_values(section, _BF16_REFUSED, "bf16")
    return {"no_nonfinite_guard": not section.get("check_grad_overflow", True)}


def precision(config: Mapping[str, Any]) -> dict[str, Any]:
    """A config naming neither bf16 nor fp16 leaves --precision; one naming either decides
    (fp32 when neither is enabled), as DeepSpeed would run it."""
    if "bf16" not in config and "fp16" not in config:
        return {}
    bf16 = bool(section_of(config.get("bf16", {}), "bf16").get("enabled", False))
    fp16 = bool(section_of(config.get("fp16", {}), "fp16").get("enabled", False))
    require(not (bf16 and fp16), "the DeepSpeed config enables both bf16 and fp16: choose one")
    fields = {"precision": "bf16" if bf16 else "fp16" if fp16 else "fp32"}
    fields.update(_fp16(config.get("fp16", {}), config))
    fields.update(_bf16(config.get("bf16", {}), config))
    return fields


_ZERO_COMMUNICATION = (
    "contiguous_gradients", "reduce_scatter", "reduce_bucket_size", "allgather_partitions",
    "allgather_bucket_size", "overlap_comm", "use_multi_rank_bucket_allreduce",
    "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold",
    "stage3_model_persistence_threshold", "stage3_max_live_parameters",
    "stage3_max_reuse_distance", "stage3_use_all_reduce_for_fetch_params",
    "stage3_allgather_sequential", "stage3_module_granularity_threshold",
    "memory_efficient_linear", "ignore_unused_parameters", "override_module_apply",
    "log_trace_cache_warnings", "enable_sanity_checks", "leaf_module",
    "stage3_gather_16bit_weights_on_model_save", "stage3_gather_fp16_weights_on_model_save",
)  # fmt: skip
"""ZeRO keys that only group or overlap communication, or choose what DeepSpeed gathers on
save (meshpipe's checkpoints always hold whole tensors by global name): accepted as is."""
_OFFLOAD = "offloading to the CPU or NVMe is not implemented: remove it (or device none)"
_ZERO_REFUSED: Refusals = {
    "offload_optimizer": (None, _OFFLOAD),
    "offload_param": (None, _OFFLOAD),
    "cpu_offload": (None, _OFFLOAD),
    "cpu_offload_param": (None, _OFFLOAD),
    "cpu_offload_use_pin_memory": (None, _OFFLOAD),
    "zenflow": (None, "ZenFlow's stale-gradient updates change the numbers: remove it"),
    "sub_group_size": (1_000_000_000, "only DeepSpeed's default (1e9) is accepted: remove it"),
    "round_robin_gradients": (False, "an offload ordering meshpipe does not implement"),
    "zero_quantized_weights": (False, "quantised communication changes the numbers"),
    "zero_quantized_nontrainable_weights": (False, "quantised weights change the numbers"),
    "zero_quantized_gradients": (False, "quantised communication changes the numbers"),
    "zero_hpz_partition_size": (1, "hierarchical partitioning (ZeRO++ hpZ) is not implemented"),
    "compute_grad_norm": (True, "meshpipe always computes the global norm (for clipping)"),
    "load_from_fp32_weights": (True, "meshpipe always resumes from its fp32 masters"),
    "elastic_checkpoint": (False, "meshpipe checkpoints are layout-free already: remove it"),
    "legacy_stage1": (False, "the legacy stage-1 partitioning is not implemented"),
    "parameter_alignment": (False, "not implemented"),
    "pipeline_loading_checkpoint": (False, "not implemented"),
    "save_muon_momentum_buffer_in_memory": (False, "meshpipe has no Muon optimizer"),
}


def _offloads_nothing(key: str, value: Any) -> bool:
    """An offload whose device is none, or an old `cpu_offload*` switch that is off."""
    if "offload" not in key:
        return False
    none = isinstance(value, Mapping) and value.get("device", "none") == "none"
    return none or value is False or value is None


def _zero(value: Any, config: Mapping[str, Any]) -> dict[str, Any]:
    """ZeRO stages map to --zero; stage 3 needs the per-tensor optimizer (set by
    `deepspeed_defaults` unless a flag chose another, which is then refused)."""
    section = section_of(value, "zero_optimization")
    check_known(section, ("stage", *_ZERO_COMMUNICATION, *_ZERO_REFUSED), "zero_optimization")
    offloading = {k: v for k, v in section.items() if not _offloads_nothing(k, v)}
    refuse_values(offloading, _ZERO_REFUSED, "zero_optimization")
    stage = zero_stage(config)
    require(
        stage in ZERO_LEVELS,
        f"zero_optimization.stage={stage}: meshpipe supports ZeRO stages "
        f"{', '.join(map(str, ZERO_LEVELS))}",
    )
    return {"zero": stage}


_RECOMPUTE_REFUSED: Refusals = {
    name: (False, reason)
    for name, reason in (
        ("partition_activations", "meshpipe keeps each stage's activations whole"),
        ("cpu_checkpointing", "meshpipe keeps checkpointed activations on the device"),
        ("contiguous_memory_optimization", "not implemented (no effect on the numbers)"),
        ("synchronize_checkpoint_boundary", "not implemented (a debugging barrier)"),
        ("profile", "not implemented: use --trace for per-action times"),
    )
}


def _activation_checkpointing(value: Any, config: Mapping[str, Any]) -> dict[str, Any]:
    """DeepSpeed's section only configures deepspeed.checkpointing; it recomputes nothing by
    itself (pipeline.activation_checkpoint_interval does), so it changes no setting."""
    section = section_of(value, "activation_checkpointing")
    check_known(section, ("number_checkpoints", *_RECOMPUTE_REFUSED), "activation_checkpointing")
    refuse_values(section, _RECOMPUTE_REFUSED, "activation_checkpointing")
    return {}


_PIPELINE_ACCEPTED = ("seed_layers", "pipe_partitioned", "grad_partitioned", "use_reentrant")
"""Ignored by DeepSpeed's engine (seed_layers; meshpipe always seeds per layer), or only
about how tensor-parallel ranks split pipeline traffic, or how recompute is implemented."""
_PIPELINE_REFUSED: Refusals = {
    "stages": ("auto", "DeepSpeed takes the stage count from PipelineModule, not the JSON: "
                       "give --pp and remove it"),
    "partition": ("best", "DeepSpeed takes the partition from PipelineModule(partition_method"
                          "=...), not the JSON: give --partition (or partition_method)"),
}  # fmt: skip


def _pipeline(value: Any, config: Mapping[str, Any]) -> dict[str, Any]:
    section = section_of(value, "pipeline")
    accepted = ("partition_method", "activation_checkpoint_interval", *_PIPELINE_ACCEPTED)
    check_known(section, (*accepted, *_PIPELINE_REFUSED), "pipeline")
    refuse_values(section, _PIPELINE_REFUSED, "pipeline")
    fields: dict[str, Any] = {}
    if "partition_method" in section:
        fields["partition"] = str(section["partition_method"])
    key = "pipeline.activation_checkpoint_interval"
    interval = number(section.get("activation_checkpoint_interval", 0), key, int)
    require(interval >= 0, f"{key}={interval}: give 0 (no recompute) or a number of layers")
    if interval > 0:
        fields["recompute"] = f"every:{interval}"
    return fields


def _data_types(value: Any, config: Mapping[str, Any]) -> dict[str, Any]:
    section = section_of(value, "data_types")
    check_known(section, ("grad_accum_dtype",), "data_types")
    reason = "meshpipe accumulates gradients in fp32: give fp32 or remove it"
    refuse_values(section, {"grad_accum_dtype": ("fp32", reason)}, "data_types")
    return {}


def _checkpoint(value: Any, config: Mapping[str, Any]) -> dict[str, Any]:
    section = section_of(value, "checkpoint")
    refusals: Refusals = {
        name: (False, "meshpipe writes its own checkpoints: remove it")
        for name in ("load_universal", "use_node_local_storage", "parallel_write")
    }
    check_known(section, ("tag_validation", *refusals), "checkpoint")
    refuse_values(section, refusals, "checkpoint")
    return {}


def _gradient_clipping(value: Any, config: Mapping[str, Any]) -> dict[str, Any]:
    return {"clip_grad_norm": number(value, "gradient_clipping")}


def _seed(value: Any, config: Mapping[str, Any]) -> dict[str, Any]:
    return {"seed": number(value, "seed", int)}


SECTION_HANDLERS: dict[str, Handler] = {
    "optimizer": _optimizer,
    "scheduler": _scheduler,
    "zero_optimization": _zero,
    "activation_checkpointing": _activation_checkpointing,
    "pipeline": _pipeline,
    "data_types": _data_types,
    "checkpoint": _checkpoint,
    "gradient_clipping": _gradient_clipping,
    "seed": _seed,
}
"""The top-level keys that shape training, honoured section by section (batch sizes and
precision are read together, by `deepspeed_config`; what a run reports:
`deepspeed_monitors.MONITOR_HANDLERS`)."""
