"""A full disk during a save is the machine's failure (status 1), said with the way out, and
leaves no partial folder behind for the resume to trip on."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from engine.checkpoint import save
from tests.faults.conftest import TINY
from tests.unit.cli_error import cli_error


def _full_disk(*args: object, **kwargs: object) -> object:
    raise OSError(errno.ENOSPC, "No space left on device")


def test_a_full_disk_during_a_save_exits_1_with_a_hint_and_no_partial_folder(
    tokens: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(save, "write_shard", _full_disk)
    argv = ["train", *TINY, "--data", tokens, "--steps", "1", "--checkpoint-dir", str(tmp_path)]
    status, err = cli_error(argv, capsys)
    assert status == 1, err
    assert "No space left on device" in err
    assert "free space on the disk of --checkpoint-dir" in err
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".tmp-step")] == []
