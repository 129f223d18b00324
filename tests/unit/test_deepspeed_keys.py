"""DeepSpeed JSON keys as DeepSpeed runs them: each top-level key is honoured or refused by
name with the reason, "auto" is filled from the flags as the Hugging Face Trainer fills it,
and a flag that contradicts the JSON is refused naming both."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any
from unittest import mock

import pytest

from engine.cli.main import build_parser
from engine.cli.train import train_config
from engine.training.config import TrainConfig
from engine.training.deepspeed_config import TOP_LEVEL_KEYS, deepspeed_overrides

BATCH: dict[str, Any] = {"train_micro_batch_size_per_gpu": 2}


def _fields(**keys: Any) -> dict[str, Any]:
    return deepspeed_overrides({**BATCH, **keys}, dp=1)


def _from_command_line(tmp_path: Path, ds_config: dict[str, Any], *flags: str) -> TrainConfig:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds_config))
    argv = ["train", "--deepspeed_config", str(path), *flags]
    return train_config(build_parser().parse_args(argv), argv)


def _keys_deepspeed_reads() -> set[str]:
    """The top-level keys DeepSpeedConfig looks up, recorded on a minimal config."""
    config = pytest.importorskip("deepspeed.runtime.config")
    seen: set[str] = set()

    class Recording(dict):  # type: ignore[type-arg]
        def get(self, key: Any, *default: Any) -> Any:
            seen.add(key)
            return super().get(key, *default)

        def __getitem__(self, key: Any) -> Any:
            seen.add(key)
            return super().__getitem__(key)

        def __contains__(self, key: Any) -> bool:
            seen.add(key)
            return super().__contains__(key)

    with (
        mock.patch.object(config.dist, "get_world_size", lambda *a, **k: 1),
        mock.patch.object(config.dist, "get_rank", lambda *a, **k: 0),
        mock.patch.object(config.dist, "is_initialized", lambda: True),
    ):
        config.DeepSpeedConfig(Recording({"train_batch_size": 1}))
    return {key for key in seen if isinstance(key, str)}


def test_every_key_deepspeed_reads_has_a_fate() -> None:
    assert _keys_deepspeed_reads() - set(TOP_LEVEL_KEYS) == set()


def test_a_key_deepspeed_does_not_know_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"keys \['zero_optimisation'\] are not supported"):
        _fields(zero_optimisation={"stage": 1})


def test_an_activation_checkpointing_section_alone_recomputes_nothing() -> None:
    section = {"partition_activations": False, "cpu_checkpointing": False,
               "contiguous_memory_optimization": False, "number_checkpoints": None,
               "synchronize_checkpoint_boundary": False, "profile": False}  # fmt: skip
    assert "recompute" not in _fields(activation_checkpointing=section)


@pytest.mark.parametrize(
    "option", ["partition_activations", "synchronize_checkpoint_boundary", "profile"]
)
def test_an_activation_checkpointing_option_meshpipe_lacks_is_refused(option: str) -> None:
    with pytest.raises(ValueError, match=f"activation_checkpointing.{option}=True"):
        _fields(activation_checkpointing={option: True})


def test_the_pipeline_checkpoint_interval_is_recompute_every_n() -> None:
    assert _fields(pipeline={"activation_checkpoint_interval": 2})["recompute"] == "every:2"


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"stages": 2}, "pipeline.stages=2: DeepSpeed takes the stage count"),
        ({"partition": "uniform"}, "pipeline.partition='uniform'"),
        ({"micro_batches": 4}, r"pipeline keys \['micro_batches'\]"),
    ],
)
def test_pipeline_keys_deepspeed_ignores_or_lacks_are_refused(
    section: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        _fields(pipeline=section)


def test_an_fp16_section_brings_deepspeeds_loss_scaling_under_zero() -> None:
    fields = _fields(fp16={"enabled": True}, zero_optimization={"stage": 1})
    expected = {"precision": "fp16", "loss_scale": 0.0, "initial_scale_power": 16,
                "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1.0}  # fmt: skip
    assert {k: fields[k] for k in expected} == expected


def test_without_zero_the_hysteresis_is_ignored_as_deepspeeds_fp16_optimizer_does() -> None:
    assert _fields(fp16={"enabled": True, "hysteresis": 4})["hysteresis"] == 1


def test_fp16_keys_reach_the_engine_options(tmp_path: Path) -> None:
    fp16 = {"enabled": True, "loss_scale": 0, "initial_scale_power": 12,
            "loss_scale_window": 500, "hysteresis": 3, "min_loss_scale": 4}  # fmt: skip
    config = TrainConfig.from_deepspeed(
        {**BATCH, "fp16": fp16, "zero_optimization": {"stage": 2}}, dp=2
    )
    options = config.engine
    settings = (options.initial_scale_power, options.loss_scale_window, options.hysteresis)
    assert (*settings, options.min_loss_scale) == (12, 500, 3, 4.0)


def test_a_static_fp16_loss_scale_is_kept() -> None:
    assert _fields(fp16={"enabled": True, "loss_scale": 1024})["loss_scale"] == 1024.0


def test_a_disabled_fp16_section_is_ignored_as_deepspeed_does() -> None:
    fields = _fields(bf16={"enabled": True}, fp16={"enabled": False, "loss_scale_window": 7})
    assert fields["precision"] == "bf16" and "loss_scale_window" not in fields


def test_bf16_without_overflow_checks_turns_the_guard_off() -> None:
    fields = _fields(bf16={"enabled": True, "check_grad_overflow": False})
    assert fields["no_nonfinite_guard"] is True


def test_fp16_enabled_by_flag_takes_deepspeeds_loss_scale_defaults(tmp_path: Path) -> None:
    config = _from_command_line(tmp_path, BATCH, "--precision", "fp16")
    assert (config.engine.loss_scale_window, config.engine.hysteresis) == (1000, 1)


ZERO_COMMUNICATION = {
    "stage": 3, "overlap_comm": True, "contiguous_gradients": True, "reduce_scatter": True,
    "reduce_bucket_size": 5e8, "allgather_bucket_size": 5e8, "allgather_partitions": True,
    "stage3_prefetch_bucket_size": 5e7, "stage3_param_persistence_threshold": 1e5,
    "sub_group_size": 1e9, "stage3_gather_16bit_weights_on_model_save": True,
}  # fmt: skip


def test_zero_communication_keys_are_accepted_and_zero_3_steps_per_tensor() -> None:
    config = TrainConfig.from_deepspeed({**BATCH, "zero_optimization": ZERO_COMMUNICATION}, dp=2)
    assert (config.engine.zero, config.optimizer.impl) == (3, "per_tensor")


def test_zero_3_with_a_fused_optimizer_flag_is_refused_clearly(tmp_path: Path) -> None:
    config = {**BATCH, "zero_optimization": {"stage": 3}}
    with pytest.raises(ValueError, match="--optimizer-impl per_tensor"):
        _from_command_line(tmp_path, config, "--dp", "2", "--optimizer-impl", "fused")


@pytest.mark.parametrize(
    ("zero", "message"),
    [
        ({"offload_optimizer": {"device": "cpu"}}, "offload_optimizer=.* offloading"),
        ({"offload_param": {"device": "nvme"}}, "offload_param=.* offloading"),
        ({"round_robin_gradients": True}, "round_robin_gradients=True"),
        ({"zero_quantized_weights": True}, "zero_quantized_weights=True"),
        ({"sub_group_size": 1000}, "sub_group_size=1000"),
    ],
)
def test_zero_keys_that_change_numbers_or_placement_are_refused(
    zero: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=f"zero_optimization.{message}"):
        _fields(zero_optimization={"stage": 2, **zero})


def test_an_offload_to_no_device_is_no_offload() -> None:
    zero = {"stage": 2, "offload_optimizer": {"device": "none"}}
    assert _fields(zero_optimization=zero)["zero"] == 2


@pytest.mark.parametrize(
    ("key", "value", "field", "expected"),
    [
        ("steps_per_print", 5, "log_every", 5),
        ("wall_clock_breakdown", True, "log_phases", True),
        ("tensorboard", {"enabled": True, "output_path": "out", "job_name": "j"},
         "tensorboard_dir", "out/j"),
        ("csv_monitor", {"enabled": True, "output_path": "out/"}, "csv_dir",
         "out/DeepSpeedJobName"),
        ("wandb", {"enabled": True, "project": "p", "group": "g"}, "wandb_project", "p"),
    ],
)  # fmt: skip
def test_harmless_sections_map_to_meshpipes_own_outputs(
    key: str, value: Any, field: str, expected: Any
) -> None:
    assert _fields(**{key: value})[field] == expected


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("comms_logger", {"enabled": False, "verbose": False}),
        ("flops_profiler", {"enabled": False, "profile_step": 1}),
        ("tensorboard", {"enabled": False}),
        ("data_types", {"grad_accum_dtype": "fp32"}),
        ("zero_allow_untested_optimizer", True),
        ("prescale_gradients", False),
    ],
)
def test_harmless_settings_are_accepted(key: str, value: Any) -> None:
    assert _fields(**{key: value})["global_batch"] == 2


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("comms_logger", {"enabled": True}, "comms_logger=.* --trace FILE"),
        ("data_types", {"grad_accum_dtype": "bf16"}, "data_types.grad_accum_dtype='bf16'"),
        ("wandb", {"enabled": True, "team": "t"}, "wandb.team='t'"),
        ("communication_data_type", "fp16", 'communication_data_type="fp16"'),
    ],
)
def test_enabled_sections_meshpipe_lacks_are_refused_by_name(
    key: str, value: Any, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        _fields(**{key: value})


def test_the_flops_profiler_maps_to_the_report_of_the_same_step() -> None:
    """DeepSpeed profiles the step run when `profile_step` steps are done: meshpipe's step
    profile_step + 1, counted from 1."""
    profiler = {"enabled": True, "profile_step": 3, "output_file": "flops.txt"}
    fields = _fields(flops_profiler=profiler)
    assert (fields["flops_profile_step"], fields["flops_profile_file"]) == (4, "flops.txt")


def test_the_flops_profiler_at_deepspeeds_defaults_reports_the_second_step() -> None:
    defaults = {"enabled": True, "module_depth": -1, "top_modules": 1, "detailed": True,
                "output_file": None, "recompute_fwd_factor": 0.0}  # fmt: skip
    fields = _fields(flops_profiler=defaults)
    assert fields["flops_profile_step"] == 2
    assert "flops_profile_file" not in fields


@pytest.mark.parametrize(
    ("key", "value"), [("module_depth", 2), ("top_modules", 3), ("detailed", False)]
)
def test_the_profilers_module_tree_settings_are_refused_by_name(key: str, value: Any) -> None:
    with pytest.raises(ValueError, match=f"flops_profiler.{key}=.*per stage and per layer"):
        _fields(flops_profiler={"enabled": True, key: value})


@pytest.mark.parametrize(
    ("factor", "flags"),
    [(0.0, {}), (1.0, {"pp": 2, "recompute": "full"}), (1.0, {"recompute": "every:2"})],
)
def test_a_recompute_fwd_factor_equal_to_the_runs_recomputation_is_accepted(
    factor: float, flags: dict[str, Any]
) -> None:
    profiler = {"enabled": True, "recompute_fwd_factor": factor}
    config = TrainConfig.from_deepspeed({**BATCH, "flops_profiler": profiler}, **flags)
    assert config.monitor.flops_profile_step == 2


@pytest.mark.parametrize(
    ("factor", "flags", "message"),
    [
        (0.5, {}, "recompute_fwd_factor=0.5 contradicts the run's --recompute none .* give 0"),
        (0.0, {"recompute": "full"}, "=0 contradicts the run's --recompute full on every stage"),
        (1.0, {"pp": 2, "recompute": "full", "recompute_stages": "1"},
         "=1 cannot describe --recompute full on stages 1 only"),
    ],
)  # fmt: skip
def test_a_recompute_fwd_factor_other_than_the_runs_is_refused_naming_both(
    factor: float, flags: dict[str, Any], message: str
) -> None:
    profiler = {"enabled": True, "recompute_fwd_factor": factor}
    with pytest.raises(ValueError, match=message):
        TrainConfig.from_deepspeed({**BATCH, "flops_profiler": profiler}, **flags)


def test_a_recompute_fwd_factor_is_checked_against_the_jsons_own_recompute() -> None:
    ds = {**BATCH, "pipeline": {"activation_checkpoint_interval": 1},
          "flops_profiler": {"enabled": True, "recompute_fwd_factor": 0.0}}  # fmt: skip
    with pytest.raises(ValueError, match="contradicts the run's --recompute every:1"):
        TrainConfig.from_deepspeed(ds)


def test_a_profile_step_flag_contradicting_the_json_is_refused(tmp_path: Path) -> None:
    ds = {**BATCH, "flops_profiler": {"enabled": True, "profile_step": 1}}
    message = "--flops-profile-step 5 contradicts flops_profiler.profile_step \\+ 1 = 2"
    with pytest.raises(ValueError, match=message):
        _from_command_line(tmp_path, ds, "--flops-profile-step", "5")


HF_ZERO2 = {
    "fp16": {"enabled": "auto", "loss_scale": 0, "initial_scale_power": 16},
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                              "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupDecayLR", "params": {
        "warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto",
        "total_num_steps": "auto"}},
    "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"},
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
}  # fmt: skip


def test_auto_values_are_filled_from_the_flags(tmp_path: Path) -> None:
    flags = ("--dp", "2", "--global-batch", "8", "--micro-batches", "2", "--lr", "0.01",
             "--precision", "bf16", "--clip-grad-norm", "0.5", "--steps", "30",
             "--warmup-steps", "3")  # fmt: skip
    config = _from_command_line(tmp_path, HF_ZERO2, *flags).flat()
    assert (config["global_batch"], config["micro_batches"], config["precision"]) == (8, 2, "bf16")
    assert (config["lr"], config["clip_grad_norm"], config["betas"]) == (0.01, 0.5, "0.9,0.95")
    schedule = json.loads(config["lr_schedule_args"])
    assert schedule == {"warmup_min_lr": 0, "warmup_max_lr": 0.01, "warmup_num_steps": 3,
                        "total_num_steps": 30}  # fmt: skip


def test_an_auto_the_trainer_would_not_fill_is_refused_by_name() -> None:
    optimizer = {"type": "SGD", "params": {"momentum": "auto"}}
    with pytest.raises(ValueError, match='optimizer.params.momentum="auto"'):
        TrainConfig.from_deepspeed({**BATCH, "optimizer": optimizer})


def test_auto_without_flags_to_fill_it_is_refused() -> None:
    with pytest.raises(ValueError, match='gradient_clipping="auto"'):
        _fields(gradient_clipping="auto")


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--global-batch", "64"), "--global-batch 64 contradicts train_batch_size 16 in .*: drop"),
        (("--precision", "fp32"), "--precision fp32 contradicts fp16/bf16 enabled \"bf16\""),
        (("--clip-grad-norm", "0"), "--clip-grad-norm 0.0 contradicts gradient_clipping 1.0"),
    ],
)  # fmt: skip
def test_a_flag_that_contradicts_the_json_is_refused_naming_both(
    tmp_path: Path, flags: tuple[str, ...], message: str
) -> None:
    ds = {"train_batch_size": 16, "bf16": {"enabled": True}, "gradient_clipping": 1.0}
    with pytest.raises(ValueError, match=message):
        _from_command_line(tmp_path, ds, *flags)


def test_a_flag_that_agrees_with_the_json_is_fine(tmp_path: Path) -> None:
    ds = {**BATCH, "optimizer": {"type": "AdamW", "params": {"betas": [0.9, 0.99]}}}
    config = _from_command_line(tmp_path, ds, "--betas", "0.9,0.99", "--global-batch", "2")
    assert config.optimizer.betas == (0.9, 0.99)


def test_the_docs_give_every_keys_fate() -> None:
    docs = (Path(__file__).parents[2] / "docs" / "DEEPSPEED.md").read_text(encoding="utf-8")
    assert [key for key in TOP_LEVEL_KEYS if f"| `{key}` |" not in docs] == []
