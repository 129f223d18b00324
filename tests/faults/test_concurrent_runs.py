"""A second run into a folder another run is training into is refused naming that run (status
2), and the first run's checkpoints are untouched by the attempt."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine.checkpoint.files import step_dirs
from engine.checkpoint.owner import OWNER_FILE
from tests.faults.conftest import TINY
from tests.unit.cli_error import cli_error

ROOT = Path(__file__).resolve().parents[2]


def _first_run(tokens: str, folder: Path) -> subprocess.Popen[str]:
    argv = ["train", *TINY, "--data", tokens, "--steps", "100000", "--save-every", "2",
            "--keep", "2", "--checkpoint-dir", str(folder)]  # fmt: skip
    command = [sys.executable, "-m", "engine.cli", *argv]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
def test_a_second_run_into_a_held_folder_is_refused_naming_the_first(
    tokens: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "ckpt"
    first = _first_run(tokens, folder)
    try:
        deadline = time.monotonic() + 120
        while not step_dirs(folder) and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert step_dirs(folder), first.communicate(timeout=5)[1] if first.poll() else "no save"
        argv = ["train", *TINY, "--data", tokens, "--steps", "4", "--lr-schedule", "constant",
                "--checkpoint-dir", str(folder), "--resume"]  # fmt: skip
        status, err = cli_error(argv, capsys)
        assert first.poll() is None, "the first run must go on"
    finally:
        first.kill()
        first.wait()
    assert status == 2
    assert f"--checkpoint-dir {folder} is in use by run" in err
    assert f"pid {first.pid}" in err
    assert (folder / OWNER_FILE).is_file()
    assert step_dirs(folder), "the first run's checkpoints are kept"
