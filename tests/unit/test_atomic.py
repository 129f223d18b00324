"""engine.atomic: all-or-nothing writes that leave files as shareable as a plain open()."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import pytest
import torch

from engine.checkpoint.atomic import atomic_write, atomic_write_text, default_file_mode
from engine.checkpoint.files import write_shard


@pytest.fixture(params=[0o022, 0o027], ids=["umask022", "umask027"])
def umask(request: pytest.FixtureRequest) -> Iterator[int]:
    """Run the test under a known umask, then put the old one back."""
    old = os.umask(request.param)
    try:
        yield request.param
    finally:
        os.umask(old)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_a_written_file_gets_the_mode_open_gives(tmp_path: Path, umask: int) -> None:
    (tmp_path / "plain").write_text("x")
    atomic_write_text(tmp_path / "atomic", "x")
    atomic_write(tmp_path / "bytes", lambda f: f.write(b"x"))
    assert _mode(tmp_path / "atomic") == _mode(tmp_path / "bytes") == _mode(tmp_path / "plain")
    assert _mode(tmp_path / "atomic") == 0o666 & ~umask


def test_the_default_mode_follows_the_umask_and_leaves_it_alone(umask: int) -> None:
    assert default_file_mode() == 0o666 & ~umask
    assert os.umask(umask) == umask  # still in force after being read


def test_a_safetensors_shard_gets_the_mode_open_gives(tmp_path: Path, umask: int) -> None:
    """safetensors' save_file writes through a 0600 temp file of its own."""
    write_shard(tmp_path, "a.safetensors", {"a": torch.zeros(2)})
    assert _mode(tmp_path / "a.safetensors") == 0o666 & ~umask


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temp(tmp_path: Path) -> None:
    target = tmp_path / "file"
    target.write_text("old")

    def half_then_fail(f: IO[bytes]) -> None:
        f.write(b"new, but only ha")
        raise OSError("No space left on device")

    with pytest.raises(OSError, match="No space left"):
        atomic_write(target, half_then_fail)
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["file"]


def test_a_write_returns_what_the_writer_returns(tmp_path: Path) -> None:
    assert atomic_write(tmp_path / "f", lambda f: f.write(b"abc")) == 3
    assert (tmp_path / "f").read_bytes() == b"abc"
