"""The launchers' `--local_rank` is accepted wherever they put it, by every subcommand."""

from __future__ import annotations

import os

import pytest

from engine.cli.main import main, without_local_rank
from tests.unit.cli_error import cli_error

SCHEDULE = ["schedule", "--schedule", "1f1b", "--pp", "2", "--micro-batches", "2"]


@pytest.mark.parametrize(
    "argv",
    [
        ["--local_rank=1", "train", "--pp", "2"],  # the deepspeed launcher's order
        ["--local-rank", "1", "train", "--pp", "2"],
        ["train", "--local_rank", "1", "--pp", "2"],
        ["train", "--pp", "2", "--local-rank=1"],
    ],
    ids=["before-equals", "before-space", "after-space", "last-equals"],
)
def test_the_flag_is_taken_out_in_every_form_and_place(argv: list[str]) -> None:
    assert without_local_rank(argv) == (["train", "--pp", "2"], "1")


def test_a_line_without_the_flag_is_left_as_it_is() -> None:
    assert without_local_rank(["train", "--pp", "2"]) == (["train", "--pp", "2"], None)


@pytest.mark.parametrize("argv", [["--local_rank=x", "train"], ["train", "--local_rank"]])
def test_a_flag_without_a_rank_number_is_refused_by_name(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    code, err = cli_error(argv, capsys)
    assert code == 2
    assert "--local_rank takes the rank's index on its host, a number such as --local_rank=0" in err


@pytest.mark.parametrize("position", [0, 1, len(SCHEDULE)])
def test_a_subcommand_runs_with_the_flag_anywhere(
    position: int, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LOCAL_RANK", "0")
    plain = main(SCHEDULE), capsys.readouterr().out
    launched = [*SCHEDULE[:position], "--local_rank=0", *SCHEDULE[position:]]
    assert (main(launched), capsys.readouterr().out) == plain


def test_the_flag_stands_in_for_a_missing_local_rank_variable(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The old `torch.distributed.launch` passes the flag only."""
    monkeypatch.setenv("LOCAL_RANK", "0")  # so that the test's end restores the environment
    monkeypatch.delenv("LOCAL_RANK")
    main(["--local-rank", "1", *SCHEDULE])
    assert os.environ["LOCAL_RANK"] == "1"
