"""Mistakes on the command line end in one line naming the problem, never a traceback."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

import engine.training.workers
from engine.cli.main import main
from engine.cli.train import interrupt_advice
from engine.comm.launch import names_a_value_error
from engine.training.config import TrainConfig
from engine.training.preflight import preflight
from tests.unit.cli_error import cli_error


def test_a_missing_deepspeed_config_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "ds.json"
    code, err = cli_error(["train", "--deepspeed_config", str(missing)], capsys)
    assert code == 2
    assert f"DeepSpeed config {missing} does not exist" in err


def test_a_deepspeed_config_that_is_not_json_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "ds.json"
    path.write_text("train_batch_size: 8\n")
    code, err = cli_error(["train", "--deepspeed_config", str(path)], capsys)
    assert code == 2
    assert f"DeepSpeed config {path} is not valid JSON" in err


@pytest.mark.parametrize(
    ("section", "key"),
    [
        ({"seed": "auto"}, "seed"),
        (
            {"optimizer": {"type": "SGD", "params": {"momentum": "auto"}}},
            "optimizer.params.momentum",
        ),
    ],
)
def test_an_auto_value_the_trainer_would_not_fill_names_its_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], section: dict[str, object], key: str
) -> None:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 8, **section}))
    code, err = cli_error(["train", "--deepspeed_config", str(path)], capsys)
    assert code == 2
    assert f'{key}="auto": meshpipe fills "auto" from its flags only where the Hugging' in err


def test_a_non_number_names_its_key(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 8, "gradient_clipping": "one"}))
    _, err = cli_error(["train", "--deepspeed_config", str(path)], capsys)
    assert "gradient_clipping='one': give a number" in err


@pytest.mark.parametrize(
    ("flag", "path", "message"),
    [
        ("--checkpoint-dir", "afile", "afile is a file, not a folder"),
        ("--metrics-file", "afile/m.jsonl", "afile is a file, not a folder"),
        ("--trace", "afile/sub/t.json", r"cannot create .*afile/sub \(Not a directory\)"),
        ("--metrics-file", ".", "is a folder: give a file name"),
    ],
)
def test_an_output_path_that_cannot_be_written_fails_before_the_first_step(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    flag: str,
    path: str,
    message: str,
) -> None:
    (tmp_path / "afile").write_text("x")
    monkeypatch.chdir(tmp_path)

    def no_training(*_: object) -> None:
        raise AssertionError("training started")

    monkeypatch.setattr(engine.training.workers, "train_worker", no_training)
    code, err = cli_error(["train", "--steps", "1", flag, path], capsys)
    assert code == 2
    assert re.search(message, err), err


@pytest.mark.parametrize("shape", [["--micro-batch-size", "0"], ["--seq-len", "100000"]])
def test_plan_refuses_a_shape_the_model_cannot_run(
    shape: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    code, err = cli_error(["plan", "--model", "gpt-tiny", "--pp", "2", *shape], capsys)
    assert code == 2
    assert "1 to 128 tokens (gpt-tiny's context)" in err


def test_an_unknown_flag_is_reported_with_its_subcommands_usage(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, err = cli_error(["plan", "--model", "gpt-tiny", "--bogus"], capsys)
    assert code == 2
    assert err.startswith("usage: meshpipe plan")
    assert "meshpipe plan: error: unrecognized arguments: --bogus" in err


def test_training_on_cuda_without_a_gpu_is_refused_before_ranks_start(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    code, err = cli_error(["train", "--model", "gpt-tiny", "--pp", "2", "--device", "cuda"], capsys)
    assert code == 2
    assert "--device cuda needs CUDA" in err and "--device cpu" in err


def test_a_new_run_says_it_replaces_an_existing_metrics_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    metrics = tmp_path / "m.jsonl"
    metrics.write_text('{"step": 0, "loss": 1.0}\n')
    preflight(TrainConfig.of(model="gpt-tiny", metrics_file=str(metrics)))
    assert f"--metrics-file {metrics} exists: this run replaces it" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--out", "--plot", "--trace"])
def test_schedule_refuses_an_unwritable_output_before_printing_its_report(
    flag: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(SystemExit) as exit_info:
        main(["schedule", "--pp", "2", "--micro-batches", "2", flag, f"{blocker}/s"])
    out, err = capsys.readouterr()
    assert exit_info.value.code == 2
    assert err.startswith(f"meshpipe: error: {flag} {blocker}/s: {blocker} is a file")
    assert out == ""


def test_plot_names_an_output_folder_it_cannot_create(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    metrics = tmp_path / "m.jsonl"
    metrics.write_text('{"step": 0, "loss": 1.0}\n')
    (tmp_path / "file").write_text("")
    code, err = cli_error(["plot", str(metrics), "--out", f"{tmp_path}/file/y.png"], capsys)
    assert code == 2 and f"--out {tmp_path}/file/y.png: {tmp_path}/file is a file, not a" in err


@pytest.mark.parametrize(
    ("checkpointing", "advice"),
    [
        ({}, r"no checkpoint was written \(--checkpoint-dir D --save-every N keep progress\)"),
        ({"save_every": 1000}, r"before its first checkpoint \(every 1000 steps\)"),
        ({"save_every": 0}, r"before its first checkpoint \(after the last step\)"),
    ],
)
def test_an_interrupted_run_advises_only_flags_it_lacks(
    checkpointing: dict[str, int], advice: str, tmp_path: Path
) -> None:
    root = {"checkpoint_dir": str(tmp_path / "ck")} if checkpointing else {}
    assert re.search(advice, interrupt_advice(TrainConfig.of(**root, **checkpointing)))


def test_max_restarts_under_an_outside_launcher_says_whose_flag_it_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    argv = ["train", "--steps", "1", "--global-batch", "2", "--micro-batches", "1"]
    argv += ["--seq-len", "16", "--no-progress", "--checkpoint-dir", str(tmp_path / "ck")]
    assert main([*argv, "--resume", "--max-restarts", "1"]) == 0
    assert "--max-restarts 1 is for meshpipe's own launcher" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("kind", "bad_input"),
    [("CheckpointError", True), ("ValueError", True), ("ExchangeError", False), ("Bogus", False)],
)
def test_a_rank_failure_is_bad_input_when_the_rank_raised_a_value_error(
    kind: str, bad_input: bool
) -> None:
    assert names_a_value_error(kind) is bad_input


def test_plot_names_a_metrics_file_that_is_not_text(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    binary = tmp_path / "m.jsonl"
    binary.write_bytes(b"\x80\xff\x00binary")
    code, err = cli_error(["plot", str(binary)], capsys)
    assert code == 2
    assert f"metrics file {binary} is not text (byte 0 is not UTF-8)" in err


def test_plot_names_a_missing_metrics_file_without_an_errno(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "m.jsonl"
    code, err = cli_error(["plot", str(missing)], capsys)
    assert code == 2
    assert f"cannot read metrics file {missing} (No such file or directory)" in err
    assert "[Errno" not in err


def test_plot_refuses_an_out_that_is_a_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    metrics = tmp_path / "m.jsonl"
    metrics.write_text('{"step": 0, "loss": 1.0}\n')
    (tmp_path / "d.png").mkdir()
    code, err = cli_error(["plot", str(metrics), "--out", f"{tmp_path}/d.png"], capsys)
    assert code == 2 and f"--out {tmp_path}/d.png: {tmp_path}/d.png is a folder" in err


@pytest.fixture
def text(tmp_path: Path) -> Path:
    path = tmp_path / "t.txt"
    path.write_text("hello\n")
    return path


def test_data_prepare_names_an_out_under_a_file(
    text: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "file").write_text("")
    out = f"{tmp_path}/file/tok"
    code, err = cli_error(["data", "prepare", str(text), "--out", out], capsys)
    assert code == 2 and f"--out {out}: {tmp_path}/file is a file, not a folder" in err


def test_data_prepare_names_an_out_that_is_a_folder(
    text: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "tok.bin").mkdir()
    out = f"{tmp_path}/tok"
    code, err = cli_error(["data", "prepare", str(text), "--out", out], capsys)
    assert code == 2 and f"--out {out}: {tmp_path}/tok.bin is a folder" in err


def test_data_prepare_names_the_out_it_cannot_write(
    text: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def refused(path: Path, *_: object) -> None:
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(sys.modules["engine.training.data"], "atomic_write", refused)
    out = f"{tmp_path}/tok"
    code, err = cli_error(["data", "prepare", str(text), "--out", out], capsys)
    assert code == 1
    assert f"--out {out}: cannot write {out}.bin (Permission denied)" in err
    assert "[Errno" not in err
