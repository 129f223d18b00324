"""`--max-restarts` retries what may pass on a second try, never bad input; when the restarts
run out, the error says so and names the checkpoint to resume from."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import engine.comm.launch
import engine.training.workers
from engine.checkpoint.files import CheckpointError
from engine.comm.launch import RankFailed
from engine.training.workers import Refused, local_worker
from tests.unit.cli_error import cli_error

ARGV = ["train", "--model", "gpt-tiny", "--pp", "2", "--steps", "4", "--max-restarts", "2",
        "--resume"]  # fmt: skip


def test_a_locally_launched_rank_returns_a_checkpoint_error_instead_of_failing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def corrupt(*_: object) -> None:
        raise CheckpointError("step-00000002/trainer.json: sha256 does not match")

    monkeypatch.setattr(engine.training.workers, "train_worker", corrupt)
    refused = local_worker(None, False)  # type: ignore[arg-type]
    assert refused == Refused("CheckpointError: step-00000002/trainer.json: sha256 does not match")


def test_other_errors_still_fail_the_rank_so_its_peers_are_stopped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def bad_batch(*_: object) -> None:
        raise ValueError("the batch does not split into micro-batches")

    monkeypatch.setattr(sys.modules["engine.training.workers"], "train_worker", bad_batch)
    with pytest.raises(ValueError, match="does not split"):
        local_worker(None, False)  # type: ignore[arg-type]


def test_a_refusal_is_bad_input_and_launched_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    launches = []

    def refusing(*args: object, **kwargs: object) -> dict[int, Refused]:
        launches.append(kwargs)
        return {0: Refused("CheckpointError: corrupt"), 1: Refused("CheckpointError: corrupt")}

    monkeypatch.setattr(engine.comm.launch, "launch_local", refusing)
    status, err = cli_error([*ARGV, "--checkpoint-dir", str(tmp_path)], capsys)
    assert status == 2
    assert "rank 0 failed: CheckpointError: corrupt" in err
    assert "restarts" not in err
    assert len(launches) == 1


def test_a_failure_after_the_last_restart_says_so_and_names_the_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "step-00000002").mkdir()
    (tmp_path / "latest").write_text("step-00000002\n")

    def crashing(*args: object, **kwargs: object) -> None:
        raise RankFailed("rank 1 failed: Signal 9 (SIGKILL) received by PID 4242")

    monkeypatch.setattr(engine.comm.launch, "launch_local", crashing)
    status, err = cli_error([*ARGV, "--checkpoint-dir", str(tmp_path)], capsys)
    assert status == 1
    assert "all 2 restarts (--max-restarts) were used" in err
    assert f"the newest checkpoint is {tmp_path / 'step-00000002'}" in err
