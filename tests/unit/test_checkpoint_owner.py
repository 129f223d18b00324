"""One run per checkpoint folder: the second is refused naming the first, a dead owner's claim
is taken over, and runs one after another share a folder freely."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from engine.checkpoint.files import CheckpointError
from engine.checkpoint.owner import (
    OWNER_FILE,
    FolderLock,
    Owner,
    check_folder_free,
    holding_folder,
)


def _owner(run: str, *, pid: int = 4242, host: str | None = None) -> Owner:
    host = host or socket.gethostname()
    return Owner(run=run, host=host, pid=pid, since="2026-11-24T10:00:00Z")


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def _claim_left_by(root: Path, owner: Owner) -> None:
    """What a run killed with -9 leaves: its owner in the file, no lock held."""
    root.mkdir(parents=True, exist_ok=True)
    (root / OWNER_FILE).write_text(json.dumps(owner.__dict__))


def test_a_second_run_is_refused_naming_the_first(tmp_path: Path) -> None:
    first = FolderLock(tmp_path, _owner("run-a", pid=111))
    assert first.acquire() is None
    second = FolderLock(tmp_path, _owner("run-b"))
    with pytest.raises(
        CheckpointError,
        match=r"in use by run run-a \(pid 111 on host .*, since 2026-11-24T10:00:00Z\).*"
        r"another --checkpoint-dir, or wait until it ends",
    ):
        second.acquire()
    first.release()


def test_the_launcher_refuses_a_held_folder_before_any_rank_starts(tmp_path: Path) -> None:
    first = FolderLock(tmp_path, _owner("run-a"))
    first.acquire()
    with pytest.raises(CheckpointError, match=r"in use by run run-a"):
        check_folder_free(tmp_path)
    first.release()


def test_the_refused_run_leaves_the_owner_in_place(tmp_path: Path) -> None:
    first = FolderLock(tmp_path, _owner("run-a"))
    first.acquire()
    with pytest.raises(CheckpointError):
        FolderLock(tmp_path, _owner("run-b")).acquire()
    assert json.loads((tmp_path / OWNER_FILE).read_text())["run"] == "run-a"
    first.release()


def test_a_dead_owner_on_this_host_is_taken_over_with_a_note(tmp_path: Path) -> None:
    pid = _dead_pid()
    _claim_left_by(tmp_path, _owner("run-a", pid=pid))
    note = FolderLock(tmp_path, _owner("run-b")).acquire()
    assert note is not None and f"from run run-a (pid {pid}" in note
    assert "ended without releasing it" in note
    assert json.loads((tmp_path / OWNER_FILE).read_text())["run"] == "run-b"


def test_the_launcher_lets_a_dead_owners_folder_be_resumed(tmp_path: Path) -> None:
    _claim_left_by(tmp_path, _owner("run-a", pid=_dead_pid()))
    check_folder_free(tmp_path)
    assert FolderLock(tmp_path, _owner("run-b")).acquire() is not None


def test_an_unreleased_owner_on_another_host_is_refused_with_how_to_clear_it(
    tmp_path: Path,
) -> None:
    _claim_left_by(tmp_path, _owner("run-a", host="elsewhere-node-7"))
    with pytest.raises(
        CheckpointError,
        match=r"pid 4242 on host elsewhere-node-7.*if that run is gone, remove .*\.meshpipe-owner",
    ):
        FolderLock(tmp_path, _owner("run-b")).acquire()


def test_a_restart_of_the_same_run_takes_its_folder_back_silently(tmp_path: Path) -> None:
    _claim_left_by(tmp_path, _owner("run-a", host="elsewhere-node-7"))
    assert FolderLock(tmp_path, _owner("run-a")).acquire() is None


def test_runs_one_after_another_share_a_folder(tmp_path: Path) -> None:
    for run in ("run-a", "run-b", "run-a"):
        lock = FolderLock(tmp_path, _owner(run))
        assert lock.acquire() is None
        lock.release()
    check_folder_free(tmp_path)
    assert (tmp_path / OWNER_FILE).read_text() == ""


def test_a_single_process_run_holds_the_folder_for_the_block_only(tmp_path: Path) -> None:
    with holding_folder(str(tmp_path), rank=0) as note:
        assert note is None
        with pytest.raises(CheckpointError, match=rf"pid \d+ on host {socket.gethostname()}"):
            check_folder_free(tmp_path)
    check_folder_free(tmp_path)


def test_no_checkpoint_folder_needs_no_lock(tmp_path: Path) -> None:
    with holding_folder(None, rank=0) as note:
        assert note is None
    assert list(tmp_path.iterdir()) == []
