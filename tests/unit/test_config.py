"""One configuration vocabulary: sections shared by TrainConfig, MemoryConfig and the engine,
each setting with one flat name (flag, DeepSpeed key, trainer.json key) and one wording."""

from __future__ import annotations

from collections import Counter

import pytest

from engine.cli.main import build_parser
from engine.config import (
    EngineOptions,
    OptimizerSpec,
    flat_fields,
    from_flat,
    replace_flat,
)
from engine.memory import MemoryConfig
from engine.training.config import TrainConfig

OLD_TRAIN_DEFAULTS = {
    "model": "gpt-tiny", "steps": 100, "global_batch": 16, "micro_batches": 4, "seq_len": 128,
    "lr": 0.001, "min_lr_ratio": 0.1, "lr_schedule": "cosine", "warmup_steps": 10,
    "optimizer": "adamw", "optimizer_impl": "fused", "weight_decay": 0.1, "seed": 0,
    "data": None, "threads": 0, "device": "auto", "metrics_file": None, "pp": 1, "dp": 1,
    "schedule": "1f1b", "partition": "balanced", "timeout": 300.0, "stages_per_rank": 1,
    "precision": "fp32", "clip_grad_norm": 1.0, "recompute": "none", "compile": False,
    "zero": 0, "no_nonfinite_guard": False, "betas": "0.9,0.95", "momentum": 0.0,
    "adam_eps": 1e-08, "lr_schedule_args": "{}", "trace": None, "log_every": 0,
    "checkpoint_dir": None, "save_every": 0, "keep": 0, "resume": False,
    "resume_fallback": False, "resume_with_new_hparams": False, "init_from": None,
    "max_restarts": 0,
}  # fmt: skip
"""TrainConfig's 43 flat fields and defaults before the sections: checkpoints record them.
Two defaults changed since, so that the README's first command learns (issue 22): lr 3e-3 → 1e-3
and clip_grad_norm 0.0 → 1.0; a checkpoint of the old defaults resumes with those flags given."""


@pytest.mark.parametrize("composite", [TrainConfig, MemoryConfig])
def test_every_flat_name_is_unique_in_a_composite(composite: type) -> None:
    counts = Counter(f.name for f in flat_fields(composite))
    assert [name for name, n in counts.items() if n > 1] == []


def test_train_keeps_every_old_setting_its_name_and_its_default() -> None:
    flat = TrainConfig.of().flat()
    assert {name: flat[name] for name in OLD_TRAIN_DEFAULTS} == OLD_TRAIN_DEFAULTS
    assert set(flat) - set(OLD_TRAIN_DEFAULTS) == {
        "cost_model",
        "device_memory",
        "mesh_order",
        "recompute_stages",
        "sequence_parallel",
        "tp",
        "zero_reshard",
        "zero_reshard_stages",
        "loss_scale",
        "initial_scale_power",
        "loss_scale_window",
        "hysteresis",
        "consecutive_hysteresis",
        "min_loss_scale",
        "tensorboard_dir",
        "csv_dir",
        "wandb_project",
        "wandb_group",
        "log_phases",
        "flops_profile_step",
        "flops_profile_file",
        "device_peak_tflops",
        "dp_sync",
        "sync_every",
        "outer_lr",
        "outer_momentum",
        "max_staleness",
        "fault_tolerant",
        "lighthouse",
        "replica_id",
        "data_order",
        "pack_documents",
        "val_data",
        "val_fraction",
        "eval_every",
        "eval_batches",
        "model_config",
        "vocab_size",
        "tokenizer",
        "placement",
    }


def test_every_train_setting_is_a_flag_of_the_same_name() -> None:
    parser = build_parser()
    train = parser._subparsers._group_actions[0].choices["train"]  # type: ignore[union-attr]
    flags = {opt for action in train._actions for opt in action.option_strings}
    assert {f"--{name.replace('_', '-')}" for name in TrainConfig.of().flat()} <= flags


def test_a_config_round_trips_through_its_flat_form() -> None:
    config = TrainConfig.of(
        pp=2, betas="0.8,0.9", no_nonfinite_guard=True, recompute="full", recompute_stages="1"
    )
    assert from_flat(TrainConfig, config.flat()) == config
    assert config.engine == EngineOptions(
        nonfinite_guard=False, recompute="full", recompute_stages=(1,), clip_grad_norm=1.0
    )
    assert config.optimizer.betas == (0.8, 0.9)


def test_a_flat_name_no_section_has_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"unknown settings \['sequence_length'\]"):
        TrainConfig.of(sequence_length=64)


def test_a_composite_keeps_its_own_defaults_for_a_shared_section() -> None:
    """Training defaults to decay 0.1 and clipping 1.0, an estimate to bf16: not the
    sections'."""
    assert (TrainConfig.of().optimizer.weight_decay, OptimizerSpec().weight_decay) == (0.1, 0.0)
    assert (TrainConfig.of().engine.clip_grad_norm, EngineOptions().clip_grad_norm) == (1.0, 0.0)
    assert (MemoryConfig.of().engine.precision, EngineOptions().precision) == ("bf16", "fp32")
    assert replace_flat(TrainConfig.of(), pp=2).optimizer.weight_decay == 0.1


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"seq_len": 4096}, "seq_len=4096 is longer than gpt-tiny's context of 128 tokens"),
        ({"pp": 8}, "cannot split gpt-tiny's 7 layers into 8 stages"),
        ({"micro_batches": 0}, "micro_batches=0 must be at least 1"),
        ({"precision": "fp8"}, "unknown precision 'fp8'"),
        ({"recompute": "half"}, "unknown recompute policy 'half'"),
        ({"recompute": "full", "recompute_stages": "5"}, r"recompute stages \[5\] are outside"),
        ({"schedule": "zb"}, "unknown schedule 'zb'"),
        ({"cost_model": "bytes"}, "unknown cost model 'bytes'"),
        ({"zero_reshard": "layer"}, "zero_reshard='layer': choose auto, step or micro-batch"),
        ({"dp": 2, "zero": 2, "zero_reshard": "micro-batch"}, "add --zero 3 or drop"),
        (
            {"dp": 2, "zero": 3, "zero_reshard": "step", "zero_reshard_stages": "0"},
            "--zero-reshard-stages 0 names the stages resharded per micro-batch, but "
            "--zero-reshard is step",
        ),
        (
            {
                "pp": 2,
                "dp": 2,
                "zero": 3,
                "zero_reshard": "micro-batch",
                "zero_reshard_stages": "2",
            },
            r"--zero-reshard-stages \[2\] are outside the run's stages 0..1",
        ),
        (
            {"pp": 2, "dp": 2, "zero": 3, "zero_reshard": "micro-batch", "schedule": "zb_h1"},
            r"--zero-reshard micro-batch with schedule zb_h1: its split backward.*use 1f1b",
        ),
    ],
)
def test_train_and_memory_refuse_a_layout_in_the_same_words(
    settings: dict[str, object], message: str
) -> None:
    errors = []
    for build in (TrainConfig.of, MemoryConfig.of):
        with pytest.raises(ValueError, match=message) as error:
            build(**settings)
        errors.append(str(error.value))
    assert errors[0] == errors[1]


def test_an_estimate_sizes_micro_batches_by_their_sequences() -> None:
    config = MemoryConfig.of(dp=2, micro_batches=4, micro_batch_size=3)
    assert (config.batch.global_batch, config.micro_batch_size) == (24, 3)
    with pytest.raises(ValueError, match="global_batch or as micro_batch_size, not both"):
        MemoryConfig.of(global_batch=24, micro_batch_size=3)


def test_an_estimate_refuses_what_it_cannot_model_by_name() -> None:
    with pytest.raises(ValueError, match="--compile: the memory model replays eager layers"):
        MemoryConfig.of(compile=True)
    with pytest.raises(ValueError, match="optimizer 'sgd': the memory model covers AdamW"):
        MemoryConfig.of(optimizer="sgd")
