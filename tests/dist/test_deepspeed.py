"""DeepSpeed interop: its JSON config drives meshpipe, and the loss curve matches DeepSpeed's
own PipelineEngine on the same model, weights, data and config (CPU, gloo, 2 ranks)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.cli.main import build_parser
from engine.cli.train import train_config
from engine.runtime.lr_schedules import deepspeed_lr, lr_multiplier
from engine.training.config import TrainConfig
from engine.training.deepspeed_config import deepspeed_overrides
from tests.dist.harness import run_ranks

DS_CONFIG: dict[str, Any] = {
    "train_batch_size": 8,
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 4,
    "optimizer": {"type": "SGD", "params": {"lr": 0.3, "momentum": 0.9}},
    "scheduler": {
        "type": "WarmupLR",
        "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 3e-3, "warmup_num_steps": 3},
    },
    "gradient_clipping": 1.0,
    "steps_per_print": 1000,
    "seed": 7,
}
BATCH_ONLY: dict[str, Any] = {"train_micro_batch_size_per_gpu": 2}
HYPERPARAMETERS = ("lr", "betas", "eps", "weight_decay")
STEPS = 4


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    out = []
    for _ in range(STEPS):
        tokens = torch.randint(0, 256, (8, 17), generator=generator)
        out.append((tokens[:, :-1], tokens[:, 1:]))
    return out


def _hyperparameters(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """lr, betas, eps and weight decay of the first parameter group (meshpipe's: matrices)."""
    group = optimizer.param_groups[0]
    return {k: tuple(group[k]) if k == "betas" else group[k] for k in HYPERPARAMETERS if k in group}


def _written(tmp_path: Path, ds_config: dict[str, Any]) -> str:
    """`ds_config` saved as the JSON file a --deepspeed_config flag names."""
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds_config))
    return str(path)


def _deepspeed_run(rank: int, world_size: int, ds_config: dict[str, Any]) -> dict[str, Any]:
    import deepspeed

    from models import layer_specs
    from scripts.deepspeed_peer import deepspeed_pipeline, micro_batch_iterator

    deepspeed.init_distributed(dist_backend="gloo")
    module = deepspeed_pipeline(layer_specs("llama-tiny"), num_stages=2, seed=7)
    params = [p for p in module.parameters() if p.requires_grad]
    engine, *_ = deepspeed.initialize(model=module, config=ds_config, model_parameters=params)
    batches = micro_batch_iterator(_batches(), 4)
    losses = [float(engine.train_batch(batches)) for _ in range(STEPS)]
    return {"losses": losses, "hyperparameters": _hyperparameters(engine.optimizer)}


def _meshpipe_run(rank: int, world_size: int, ds_json: str) -> dict[str, Any]:
    """`meshpipe train --deepspeed_config ds_json`'s settings, stepped by hand."""
    from engine.comm.mesh import init_mesh
    from engine.runtime.engine import PipelineEngine
    from models import layer_specs
    from partitioners import partition_model

    config = TrainConfig.from_deepspeed(ds_json, model="llama-tiny", pp=2, seq_len=16)
    specs = layer_specs("llama-tiny")
    engine = PipelineEngine(
        specs,
        init_mesh(2, 1, timeout_s=60),
        partition=partition_model(specs, method="uniform", num_stages=2),
        micro_batches=config.flat()["micro_batches"],
        seed=config.flat()["seed"],
        optimizer=config.optimizer,
        options=config.engine,
    )
    assert engine.optimizer is not None
    flat = config.flat()
    multiplier = lr_multiplier(config.learning_rate, total_steps=flat["steps"], lr=flat["lr"])
    losses = []
    for step, (inputs, targets) in enumerate(_batches()):
        for group in engine.optimizer.param_groups:
            group["lr"] = config.flat()["lr"] * multiplier(step)
        losses.append(engine.train_step(inputs, targets).loss)
    return {"losses": losses, "hyperparameters": _hyperparameters(engine.optimizer)}


def _both(ds_config: dict[str, Any], tmp_path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(meshpipe's, DeepSpeed's) run of one JSON, each on two pipeline ranks: the losses and
    the optimizer's hyper-parameters after the last step."""
    pytest.importorskip("deepspeed", reason="deepspeed is not installed (pip install .[deepspeed])")
    path = _written(tmp_path, ds_config)
    theirs = run_ranks(_deepspeed_run, 2, ds_config, timeout_s=300)
    ours = run_ranks(_meshpipe_run, 2, path, timeout_s=300)
    assert ours[0]["losses"] == ours[1]["losses"]
    return ours[0], theirs[1]


def test_same_json_gives_deepspeeds_loss_curve(tmp_path: Path) -> None:
    ours, theirs = _both(DS_CONFIG, tmp_path)
    assert ours["losses"] == pytest.approx(theirs["losses"], rel=1e-5)


ADAM_WITHOUT_SCHEDULER = {k: v for k, v in DS_CONFIG.items() if k != "scheduler"}


def test_an_adam_json_omitting_params_builds_deepspeeds_optimizer(tmp_path: Path) -> None:
    """DeepSpeed's betas (0.9, 0.999), torch AdamW's decay 0.01 and a constant lr, not
    meshpipe's defaults (0.9, 0.95, 0.1, cosine)."""
    adam = {"type": "AdamW", "params": {"lr": 1e-3, "eps": 1e-6, "torch_adam": True}}
    ours, theirs = _both({**ADAM_WITHOUT_SCHEDULER, "optimizer": adam}, tmp_path)
    expected = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-6, "weight_decay": 0.01}
    assert ours["hyperparameters"] == theirs["hyperparameters"] == expected


def test_an_adam_json_gives_deepspeeds_loss_curve(tmp_path: Path) -> None:
    """Without decay, as DeepSpeed decays every parameter it is given and meshpipe matrices."""
    adam = {"type": "AdamW", "params": {"lr": 1e-3, "eps": 1e-6, "weight_decay": 0.0,
                                        "torch_adam": True}}  # fmt: skip
    ours, theirs = _both({**ADAM_WITHOUT_SCHEDULER, "optimizer": adam}, tmp_path)
    assert ours["losses"] == pytest.approx(theirs["losses"], rel=1e-5)


def test_deepspeed_schedulers_are_reproduced_step_by_step() -> None:
    pytest.importorskip("deepspeed", reason="deepspeed is not installed")
    from deepspeed.runtime import lr_schedules

    cases = {
        "WarmupLR": {"warmup_min_lr": 1e-4, "warmup_max_lr": 3e-3, "warmup_num_steps": 10},
        "WarmupDecayLR": {
            "warmup_max_lr": 3e-3,
            "warmup_num_steps": 5,
            "total_num_steps": 30,
            "warmup_type": "linear",
        },
        "WarmupCosineLR": {"warmup_min_ratio": 0.1, "warmup_num_steps": 5, "total_num_steps": 30},
    }
    for kind, params in cases.items():
        param = torch.nn.Parameter(torch.zeros(1))
        optimizer = torch.optim.SGD([param], lr=2e-3)
        scheduler = getattr(lr_schedules, kind)(optimizer, **params)
        for step in range(40):
            expected = optimizer.param_groups[0]["lr"]
            assert deepspeed_lr(step, kind, params, 2e-3) == pytest.approx(expected, abs=1e-15)
            scheduler.step()


@pytest.mark.parametrize("kind", ["WarmupLR", "WarmupDecayLR"])
def test_an_omitted_warmup_max_lr_means_deepspeeds_default(kind: str) -> None:
    pytest.importorskip("deepspeed", reason="deepspeed is not installed")
    from deepspeed.runtime import lr_schedules

    params: dict[str, Any] = {"warmup_num_steps": 2}
    if kind == "WarmupDecayLR":
        params["total_num_steps"] = 6
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=0.01)
    scheduler = getattr(lr_schedules, kind)(optimizer, **params)
    for step in range(6):
        expected = optimizer.param_groups[0]["lr"]
        assert deepspeed_lr(step, kind, params, 0.01) == pytest.approx(expected, abs=1e-15)
        scheduler.step()


def test_batch_sizes_must_agree_as_deepspeed_requires() -> None:
    bad = {**DS_CONFIG, "train_batch_size": 10}
    with pytest.raises(
        ValueError, match=r"train_batch_size 10 != .* 2 × .* 4 × data-parallel size 1"
    ):
        deepspeed_overrides(bad, dp=1)


def test_missing_batch_size_is_derived_from_the_other_two() -> None:
    config = {k: v for k, v in DS_CONFIG.items() if k != "gradient_accumulation_steps"}
    assert deepspeed_overrides(config, dp=2)["micro_batches"] == 2


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("zero_optimization", {"stage": 4}, "ZeRO stages 0, 1, 2"),
        ("amp", {"enabled": True}, r"amp=\{\"enabled\": true\} is refused: NVIDIA Apex AMP"),
        ("ampp", {"enabled": True}, r"keys \['ampp'\] are not supported"),
        ("optimizer", {"type": "Lamb"}, "optimizer type 'Lamb' is not supported"),
        ("scheduler", {"type": "OneCycle"}, "scheduler type 'OneCycle' is not supported"),
        ("activation_checkpointing", {"cpu_checkpointing": True}, "cpu_checkpointing"),
    ],
)
def test_unsupported_keys_are_rejected_by_name(key: str, value: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        deepspeed_overrides({**DS_CONFIG, key: value}, dp=1)


def test_a_train_batch_size_alone_means_no_gradient_accumulation() -> None:
    fields = deepspeed_overrides({"train_batch_size": 8}, dp=2)
    assert (fields["global_batch"], fields["micro_batches"]) == (8, 1)


def test_a_config_without_either_batch_size_is_rejected_naming_both() -> None:
    with pytest.raises(ValueError, match="neither train_batch_size nor train_micro_batch_size"):
        deepspeed_overrides({"gradient_accumulation_steps": 2}, dp=1)


def test_a_batch_size_below_one_is_rejected_by_name() -> None:
    with pytest.raises(ValueError, match="gradient_accumulation_steps=0: give a whole number"):
        deepspeed_overrides({"train_batch_size": 8, "gradient_accumulation_steps": 0}, dp=1)


@pytest.mark.parametrize("kind", ["WarmupDecayLR", "WarmupCosineLR"])
def test_a_decaying_scheduler_without_total_num_steps_is_rejected_up_front(kind: str) -> None:
    scheduler = {"type": kind, "params": {"warmup_num_steps": 2}}
    with pytest.raises(ValueError, match=f"{kind} needs params.total_num_steps"):
        deepspeed_overrides({**BATCH_ONLY, "scheduler": scheduler}, dp=1)


def test_a_schedule_given_by_flags_fails_at_step_0_not_mid_run() -> None:
    with pytest.raises(ValueError, match="needs params.total_num_steps"):
        deepspeed_lr(0, "WarmupDecayLR", {"warmup_num_steps": 2}, 1e-3)


@pytest.mark.parametrize(
    ("kind", "params", "message"),
    [
        ("WarmupLR", {"warmup_num_step": 2}, r"WarmupLR params \['warmup_num_step'\]"),
        (
            "WarmupCosineLR",
            {"total_num_steps": 9, "warmup_max_lr": 0.1},
            r"WarmupCosineLR params \['warmup_max_lr'\]",
        ),
        ("WarmupLR", {"warmup_num_steps": 0}, "warmup_num_steps=0"),
        ("WarmupLR", {"warmup_type": "linaer"}, "warmup_type='linaer'"),
        ("WarmupLR", {"last_batch_iteration": 5}, "last_batch_iteration=5"),
    ],
)
def test_a_scheduler_param_deepspeed_would_not_run_alike_is_rejected_by_name(
    kind: str, params: dict[str, Any], message: str
) -> None:
    scheduler = {"type": kind, "params": params}
    with pytest.raises(ValueError, match=message):
        deepspeed_overrides({**BATCH_ONLY, "scheduler": scheduler}, dp=1)


def _with_optimizer(kind: str, **params: Any) -> dict[str, Any]:
    return {**BATCH_ONLY, "optimizer": {"type": kind, "params": params}}


def test_an_adam_eps_becomes_the_adam_eps_flag(tmp_path: Path) -> None:
    path = _written(tmp_path, _with_optimizer("Adam", eps=1e-5))
    config = TrainConfig.from_deepspeed(path, dp=2)
    flat = config.flat()
    assert (flat["optimizer"], flat["adam_eps"], config.optimizer.eps) == ("adamw", 1e-5, 1e-5)


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        ({"lr": 0.01}, {"betas": "0.9,0.999", "adam_eps": 1e-8, "weight_decay": 0.0}),
        ({"torch_adam": True}, {"lr": 1e-3, "weight_decay": 0.01}),
    ],
)
def test_adam_params_the_json_omits_take_deepspeeds_defaults(
    tmp_path: Path, params: dict[str, Any], expected: dict[str, Any]
) -> None:
    path = _written(tmp_path, _with_optimizer("AdamW", **params))
    config = TrainConfig.from_deepspeed(path, dp=2).flat()
    assert {name: config[name] for name in expected} == expected


def test_a_flag_given_for_an_omitted_param_wins_over_deepspeeds_default(tmp_path: Path) -> None:
    path = _written(tmp_path, _with_optimizer("AdamW", lr=0.01))
    config = TrainConfig.from_deepspeed(path, dp=2, weight_decay=0.05, betas="0.8,0.9")
    flat = config.flat()
    assert (flat["weight_decay"], flat["betas"], flat["adam_eps"]) == (0.05, "0.8,0.9", 1e-8)


def test_a_json_without_an_optimizer_keeps_meshpipes_optimizer_defaults(tmp_path: Path) -> None:
    path = _written(tmp_path, BATCH_ONLY)
    config = TrainConfig.from_deepspeed(path, dp=2)
    flat, ours = config.flat(), TrainConfig.of().flat()
    assert (flat["weight_decay"], flat["betas"]) == (ours["weight_decay"], ours["betas"])


def test_adam_with_l2_regularisation_is_rejected_by_name() -> None:
    with pytest.raises(ValueError, match="adam_w_mode false .* use type AdamW"):
        deepspeed_overrides(_with_optimizer("Adam", weight_decay=0.01, adam_w_mode=False), dp=1)


def test_adamw_ignores_adam_w_mode_as_deepspeed_does() -> None:
    fields = deepspeed_overrides(_with_optimizer("AdamW", adam_w_mode=False), dp=1)
    assert fields["optimizer"] == "adamw"


@pytest.mark.parametrize(
    ("kind", "params", "unknown"),
    [("SGD", {"betas": [0.9, 0.99]}, "betas"), ("Adam", {"momentum": 0.9}, "momentum")],
)
def test_a_param_the_optimizer_does_not_take_is_rejected_by_name(
    kind: str, params: dict[str, Any], unknown: str
) -> None:
    with pytest.raises(ValueError, match=rf"optimizer {kind} params \['{unknown}'\]"):
        deepspeed_overrides(_with_optimizer(kind, **params), dp=1)


def test_config_maps_to_train_fields(tmp_path: Path) -> None:
    path = _written(
        tmp_path, {**DS_CONFIG, "bf16": {"enabled": True}, "zero_optimization": {"stage": 1}}
    )
    fields = deepspeed_overrides(path, dp=1)
    assert fields["precision"] == "bf16" and fields["zero"] == 1
    assert fields["clip_grad_norm"] == 1.0 and fields["lr_schedule"] == "deepspeed:WarmupLR"
    assert (fields["global_batch"], fields["micro_batches"], fields["optimizer"]) == (8, 4, "sgd")


@pytest.mark.parametrize(
    ("flag", "value"), [("precision", "bf16"), ("zero", 1), ("clip_grad_norm", 0.5)]
)
def test_a_key_the_json_omits_leaves_the_flag(tmp_path: Path, flag: str, value: Any) -> None:
    path = _written(tmp_path, BATCH_ONLY)
    config = TrainConfig.from_deepspeed(path, dp=2, **{flag: value})
    assert config.flat()[flag] == value


def test_a_json_and_flags_without_clipping_clip_at_deepspeeds_default(tmp_path: Path) -> None:
    path = _written(tmp_path, BATCH_ONLY)
    assert TrainConfig.from_deepspeed(path, dp=2).flat()["clip_grad_norm"] == 1.0


@pytest.mark.parametrize(
    ("key", "value", "flag", "expected"),
    [
        ("fp16", {"enabled": False}, "precision", "fp32"),
        ("zero_optimization", {}, "zero", 0),
        ("gradient_clipping", 0.0, "clip_grad_norm", 0.0),
    ],
)
def test_a_key_the_json_has_overrides_the_flag(
    key: str, value: Any, flag: str, expected: Any
) -> None:
    flags = {"precision": "bf16", "zero": 1, "clip_grad_norm": 0.5}
    fields = deepspeed_overrides({**BATCH_ONLY, key: value}, dp=2)
    assert {**flags, **fields}[flag] == expected


def _from_command_line(tmp_path: Path, ds_config: dict[str, Any], *flags: str) -> TrainConfig:
    path = _written(tmp_path, ds_config)
    argv = ["train", "--deepspeed_config", path, "--dp", "2", *flags]
    return train_config(build_parser().parse_args(argv), argv)


def test_a_flag_given_at_meshpipes_default_still_counts(tmp_path: Path) -> None:
    adam = _with_optimizer("AdamW", lr=0.01)
    config = _from_command_line(tmp_path, adam, "--weight-decay", "0.1", "--clip-grad-norm", "0")
    flat = config.flat()
    assert (flat["weight_decay"], flat["clip_grad_norm"], flat["betas"]) == (0.1, 0.0, "0.9,0.999")


def test_flags_not_given_take_deepspeeds_defaults(tmp_path: Path) -> None:
    config = _from_command_line(tmp_path, _with_optimizer("AdamW", lr=0.01), "--no-progress")
    flat = config.flat()
    assert (flat["weight_decay"], flat["clip_grad_norm"], flat["lr_schedule"]) == (
        0.0,
        1.0,
        "constant",
    )


def _train_losses(rank: int, world_size: int, config: TrainConfig) -> tuple[float, ...]:
    from engine.training.loop import train

    return train(config, progress=False).losses


def test_a_csv_monitor_is_written_once_by_rank_0_with_the_runs_losses(tmp_path: Path) -> None:
    ds_config = {
        "train_batch_size": 4,
        "train_micro_batch_size_per_gpu": 2,
        "csv_monitor": {"enabled": True, "output_path": str(tmp_path), "job_name": "job"},
    }
    config = TrainConfig.from_deepspeed(ds_config, pp=2, steps=2, seq_len=16)
    losses = run_ranks(_train_losses, 2, config, timeout_s=300)[1]
    rows = (tmp_path / "job" / "Train_Samples_train_loss.csv").read_text().splitlines()
    assert rows[0] == "step,train_loss"
    assert [(int(s), float(v)) for s, v in (r.split(",") for r in rows[1:])] == [
        (4, pytest.approx(losses[0], rel=1e-6)),
        (8, pytest.approx(losses[1], rel=1e-6)),
    ]

