"""The single-process reference trainer, its config and the `meshpipe train` CLI."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from engine import TrainConfig, accumulate_gradients, lr_factor, split_micro_batches, train
from engine.cli.main import build_parser, main
from engine.runtime.optim import build_from_spec
from engine.schedule.generators import SCHEDULES
from engine.training.data import prepare
from models import build_layers, layer_specs, lm_loss

torch.set_num_threads(1)


def test_micro_batches_are_equal_views_in_order() -> None:
    batch = torch.arange(12).view(6, 2)
    parts = split_micro_batches(batch, 3)
    assert [p.tolist() for p in parts] == [[[0, 1], [2, 3]], [[4, 5], [6, 7]], [[8, 9], [10, 11]]]
    assert parts[1].data_ptr() == batch[2].data_ptr()


def test_batch_that_does_not_split_is_rejected() -> None:
    with pytest.raises(ValueError, match="batch of 6 sequences does not split into 4"):
        split_micro_batches(torch.zeros(6, 2), 4)


def test_accumulated_gradients_equal_full_batch_gradients() -> None:
    specs = layer_specs("gpt-tiny")
    inputs = torch.randint(0, 256, (8, 16))
    targets = torch.randint(0, 256, (8, 16))
    accumulated, full = build_layers(specs, seed=1), build_layers(specs, seed=1)
    loss = accumulate_gradients(accumulated, inputs, targets, micro_batches=4)
    full_loss = lm_loss(full(inputs), targets)
    full_loss.backward()
    assert loss.item() == pytest.approx(full_loss.item(), rel=1e-6)
    for (name, a), (_, b) in zip(
        accumulated.named_parameters(), full.named_parameters(), strict=True
    ):
        assert a.grad is not None and b.grad is not None
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize(
    ("schedule", "step", "factor"),
    [
        ("cosine", 0, 0.25),
        ("cosine", 3, 1.0),
        ("cosine", 14, 0.1),
        ("cosine", 9, 0.55),
        ("linear", 9, 0.55),
        ("constant", 20, 1.0),
    ],
)
def test_lr_warms_up_then_decays(schedule: str, step: int, factor: float) -> None:
    got = lr_factor(step, schedule=schedule, warmup_steps=4, total_steps=14, min_ratio=0.1)
    assert got == pytest.approx(factor)


def test_training_lowers_the_loss_on_the_default_corpus(tmp_path: Path) -> None:
    config = TrainConfig.of(
        steps=40, global_batch=8, micro_batches=2, seq_len=64, lr=3e-3, warmup_steps=5
    )
    result = train(config, progress=False)
    assert len(result.losses) == 40
    assert sum(result.losses[-5:]) / 5 < result.losses[0] - 1.0


def test_training_is_deterministic() -> None:
    config = TrainConfig.of(steps=3, global_batch=4, micro_batches=2, seq_len=32)
    assert train(config, progress=False).losses == train(config, progress=False).losses


def test_log_every_lines_stand_on_their_own_lines_beside_the_progress_bar(
    capsys: pytest.CaptureFixture[str],
) -> None:
    config = TrainConfig.of(steps=2, global_batch=4, micro_batches=2, seq_len=32, log_every=1)
    train(config, progress=True)
    shown = [line.rsplit("\r", 1)[-1] for line in capsys.readouterr().err.split("\n")]
    logged = [line for line in shown if "loss" in line and line.startswith("meshpipe: step")]
    assert [line.split(":")[1] for line in logged] == [" step 1", " step 2"]


def test_cli_trains_on_prepared_data_and_writes_metrics(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "corpus.txt").write_text("the quick brown fox jumps over the lazy dog\n" * 200)
    prepare(tmp_path / "corpus.txt", tmp_path / "tokens")
    metrics = tmp_path / "metrics.jsonl"
    argv = [
        "train",
        "--data",
        str(tmp_path / "tokens"),
        "--steps",
        "3",
        "--global-batch",
        "4",
        "--micro-batches",
        "2",
        "--seq-len",
        "32",
        "--metrics-file",
        str(metrics),
        "--no-progress",
    ]
    assert main(argv) == 0
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2]
    assert {"loss", "lr", "tokens_per_s", "step_s"} <= set(records[0])
    assert "final loss" in capsys.readouterr().out


def test_cli_data_prepare_writes_a_token_file(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("hello")
    assert main(["data", "prepare", str(tmp_path), "--out", str(tmp_path / "out")]) == 0
    assert (tmp_path / "out.bin").read_bytes() == b"hello"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--global-batch", "6", "--micro-batches", "4"], "does not split into 4 micro-batches"),
        (["--model", "gpt5"], "unknown model 'gpt5'.*gpt-tiny"),
        (["--seq-len", "512"], "longer than gpt-tiny's context of 128"),
        (["--data", "/nonexistent/tokens"], "nonexistent"),
        (["--optimizer", "lion"], "unknown optimizer 'lion'"),
        (["--pp", "2", "--partition", "bogus"], "unknown partition method 'bogus'"),
        (["--pp", "2", "--stages-per-rank", "2"], "'1f1b' runs one stage per rank"),
        (["--pp", "2", "--schedule", "interleaved_1f1b"], "give --stages-per-rank 2 or more"),
        (["--schedule", "nowhere.csv"], "schedule file nowhere.csv does not exist"),
        (["--schedule", "nowhere"], "unknown schedule 'nowhere'.*schedule file"),
        (["--weight-decay", "-1"], "weight_decay=-1.0 must be >= 0"),
        (["--optimizer", "sgd", "--momentum", "2"], r"momentum=2.0 must be in \[0, 1\)"),
        (["--betas", "0.9,1.5"], r"each must be in \[0, 1\)"),
        (["--log-every", "-1"], "log_every=-1 must be >= 0"),
        (
            ["--lr-schedule", "deepspeed:WarmupLR", "--lr-schedule-args", "notjson"],
            "--lr-schedule-args 'notjson' is not a JSON object",
        ),
        (["--lr-schedule-args", '{"a": 1}'], "is for the deepspeed:\\* schedules"),
    ],
)
def test_cli_rejects_bad_input_before_compute(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--steps", "1", "--no-progress", *argv])
    assert exit_info.value.code == 2
    assert re.search(message, capsys.readouterr().err)


def test_train_help_names_every_schedule(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--help"])
    help_text = capsys.readouterr().out
    assert [name for name in SCHEDULES if not re.search(rf"\b{name}\b", help_text)] == []


@pytest.mark.parametrize("impl", ["fused", "per_tensor", "deepspeed_cpu"])
def test_adam_eps_reaches_every_optimizer_implementation(impl: str) -> None:
    if impl == "deepspeed_cpu":
        pytest.importorskip("deepspeed", reason="deepspeed is not installed")
    spec = TrainConfig.of(adam_eps=1e-5, optimizer_impl=impl).optimizer
    optimizer = build_from_spec(spec, torch.nn.Linear(2, 2))
    assert {group["eps"] for group in optimizer.param_groups} == {1e-5}


def test_a_non_positive_adam_eps_is_rejected_by_name() -> None:
    with pytest.raises(ValueError, match="adam_eps=0.0 must be a positive number"):
        TrainConfig.of(adam_eps=0.0)


def test_data_prepare_says_when_it_replaces_a_token_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = tmp_path / "a.txt"
    source.write_text("some text to tokenize\n")
    assert main(["data", "prepare", str(source), "--out", str(tmp_path / "t")]) == 0
    assert "replacing" not in capsys.readouterr().err
    assert main(["data", "prepare", str(source), "--out", str(tmp_path / "t")]) == 0
    assert f"replacing the token file {tmp_path / 't.bin'}" in capsys.readouterr().err


def test_partition_memory_splits_a_run_by_the_memory_model_of_its_device() -> None:
    from engine.training.preflight import stage_partition

    fits = TrainConfig.of(model="gpt-small", pp=4, partition="memory", device_memory="1GB")
    tight = TrainConfig.of(model="gpt-small", pp=4, partition="memory", device_memory="6MB")
    assert stage_partition(fits, fits.model.specs()).num_stages == 4
    with pytest.raises(ValueError, match="--partition memory: .*no split fits 5.7 MiB"):
        stage_partition(tight, tight.model.specs())
