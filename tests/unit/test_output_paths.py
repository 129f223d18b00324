"""No command writes over what it reads or what another of its flags writes: each collision is
refused before anything is written, naming both flags, and distinct paths still work."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import engine.training.workers
from engine.checkpoint.files import LATEST, TRAINER_FILE
from engine.cli.main import main
from engine.training.data import prepare
from engine.training.paths import check_paths, file_in, file_out
from tests.unit.cli_error import cli_error


@pytest.fixture
def at(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A folder to run in, holding token file `tok` and a checkpoint folder `ck` with
    `ck/step-00000001` (the rules read only their names and `trainer.json`)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "text.txt").write_text("some text to train on\n" * 4)
    prepare(tmp_path / "text.txt", tmp_path / "tok")
    step = tmp_path / "ck" / "step-00000001"
    step.mkdir(parents=True)
    (step / TRAINER_FILE).write_text('{"step": 1}\n')
    (tmp_path / "ck" / LATEST).write_text("step-00000001\n")

    def no_training(*_: object) -> None:
        raise AssertionError("training started")

    monkeypatch.setattr(engine.training.workers, "train_worker", no_training)
    return tmp_path


def _bytes(folder: Path) -> dict[str, bytes]:
    """Every file under `folder` and its content."""
    return {str(p): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--data", "tok", "--metrics-file", "tok.json"], ("--metrics-file tok.json", "--data")),
        (["--data", "tok.json", "--trace", "tok.bin"], ("--trace tok.bin", "--data tok.json")),
        (["--metrics-file", "x", "--trace", "x"], ("--metrics-file x", "--trace x")),
        (["--csv-dir", "m", "--metrics-file", "m"], ("--csv-dir m", "--metrics-file m")),
        (["--checkpoint-dir", "new", "--trace", "new/latest"], ("--trace", "--checkpoint-dir")),
        (
            ["--checkpoint-dir", "new", "--metrics-file", "new/.meshpipe-owner"],
            ("--metrics-file", "--checkpoint-dir"),
        ),
        (["--init-from", "ck", "--metrics-file", "ck/latest"], ("--metrics-file", "--init-from")),
        (["--metrics-file", "ck/step-00000001/m.jsonl"], ("--metrics-file", "checkpoint")),
    ],
)
def test_train_refuses_an_output_over_an_input_or_another_output(
    at: Path, capsys: pytest.CaptureFixture[str], argv: list[str], named: tuple[str, str]
) -> None:
    before = _bytes(at)
    code, err = cli_error(["train", "--steps", "1", *argv], capsys)
    assert code == 2
    assert all(name in err for name in named), err
    assert _bytes(at) == before


def test_train_refuses_a_metrics_file_named_like_its_deepspeed_config(
    at: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (at / "ds.json").write_text(json.dumps({"train_batch_size": 8}))
    argv = ["train", "--deepspeed_config", "ds.json", "--metrics-file", "ds.json"]
    code, err = cli_error(argv, capsys)
    assert code == 2
    assert "--metrics-file ds.json would write over or into --deepspeed_config ds.json" in err
    assert json.loads((at / "ds.json").read_text()) == {"train_batch_size": 8}


@pytest.mark.parametrize(
    "argv",
    [
        [
            "--data",
            "tok",
            "--seq-len",
            "32",
            "--metrics-file",
            "ck/m.jsonl",
            "--trace",
            "tok.trace.json",
        ],
        ["--csv-dir", "ck", "--tensorboard-dir", "ck"],
    ],
)
def test_train_starts_with_outputs_beside_its_checkpoints_and_inputs(
    at: Path, argv: list[str]
) -> None:
    with pytest.raises(AssertionError, match="training started"):
        main(["train", "--steps", "1", "--checkpoint-dir", "ck", "--resume", *argv])


def test_schedule_refuses_to_write_into_a_checkpoint(
    at: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = _bytes(at)
    code, err = cli_error(["schedule", "--out", "ck/step-00000001/trainer.json"], capsys)
    assert code == 2
    assert "--out ck/step-00000001/trainer.json lies inside the checkpoint" in err
    assert _bytes(at) == before


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--load", "s.txt", "--out", "s.txt"], "--out s.txt would write over or into --load"),
        (["--plot", "p", "--trace", "p.png"], "--plot p and --trace p.png write to the same"),
    ],
)
def test_schedule_refuses_colliding_paths_before_its_report(
    at: Path, capsys: pytest.CaptureFixture[str], argv: list[str], named: str
) -> None:
    (at / "s.txt").write_text("0F0 0B0\n")
    code, err = cli_error(["schedule", *argv], capsys)
    assert code == 2 and named in err
    assert (at / "s.txt").read_text() == "0F0 0B0\n"


def test_plot_refuses_a_png_over_its_metrics_file(
    at: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (at / "m.png").write_text('{"step": 0, "loss": 1.0}\n')
    code, err = cli_error(["plot", "m.png"], capsys)
    assert code == 2 and "--out m.png would write over or into METRICS m.png" in err
    assert (at / "m.png").read_text() == '{"step": 0, "loss": 1.0}\n'


def test_data_prepare_refuses_to_write_over_its_source(
    at: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = _bytes(at)
    code, err = cli_error(["data", "prepare", "tok.json", "--out", "tok"], capsys)
    assert code == 2 and "--out tok would write over or into SOURCE tok.json" in err
    assert _bytes(at) == before


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["export", "--checkpoint", "ck", "--out", "ck/latest"], "--checkpoint ck"),
        (["export", "--checkpoint", "ck", "--out", "ck/step-00000001/hf"], "the checkpoint"),
        (["import", "hf", "--out", "hf/ck"], "SOURCE hf"),
    ],
)
def test_export_and_import_refuse_an_output_inside_their_input(
    at: Path, capsys: pytest.CaptureFixture[str], argv: list[str], named: str
) -> None:
    (at / "hf").mkdir()
    (at / "hf" / "config.json").write_text("{}")
    before = _bytes(at)
    code, err = cli_error(argv, capsys)
    assert code == 2 and f"--out {argv[-1]}" in err and named in err
    assert _bytes(at) == before


def test_a_hard_link_to_an_input_is_the_input(tmp_path: Path) -> None:
    (tmp_path / "in.json").write_text("{}")
    os.link(tmp_path / "in.json", tmp_path / "link.json")
    uses = [file_in("--load", tmp_path / "in.json"), file_out("--out", tmp_path / "link.json")]
    with pytest.raises(ValueError, match="would write over or into --load"):
        check_paths(uses)


def test_distinct_paths_pass(tmp_path: Path) -> None:
    uses = [file_in("--load", tmp_path / "a"), file_out("--out", tmp_path / "b")]
    check_paths(uses)
    assert not (tmp_path / "b").exists()


@pytest.mark.parametrize(
    ("argv", "written"),
    [
        (["data", "prepare", "tok.json", "--out", "again"], "again.json"),
        (["schedule", "--load", "s.txt", "--out", "s.csv"], "s.csv"),
    ],
)
def test_commands_write_to_distinct_paths(at: Path, argv: list[str], written: str) -> None:
    main(["schedule", "--pp", "2", "--micro-batches", "2", "--out", "s.txt"])
    assert main(argv) == 0
    assert (at / written).is_file()
