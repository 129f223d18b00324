"""A rank stopped mid-run (SIGSTOP) is named by rank, stage and action within --timeout + 5 s,
and `meshpipe train` returns within that too, leaving nothing in the temp folder."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 10
ARGS = ["train", "--model", "gpt-tiny", "--pp", "2", "--dp", "2", "--steps", "100000",
        "--global-batch", "4", "--seq-len", "16", "--micro-batches", "2", "--threads", "1",
        "--timeout", str(TIMEOUT_S), "--no-progress"]  # fmt: skip
STOPPED_RANK = 1  # stage 0, dp replica 1: a data-parallel peer and a pipeline peer wait on it


def _record(temp: Path, rank: int) -> dict[str, object] | None:
    for path in temp.glob(f"meshpipe-ranks-*/rank-{rank:05d}.json"):
        try:
            record: dict[str, object] = json.loads(path.read_text())
            return record
        except ValueError:
            return None  # being replaced
    return None


def _pid_once_training(temp: Path, job: subprocess.Popen[str], *, within_s: float) -> int:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline and job.poll() is None:
        record = _record(temp, STOPPED_RANK)
        if record is not None and isinstance(record["step"], int) and record["step"] >= 1:
            return int(str(record["pid"]))
        time.sleep(0.2)
    job.kill()
    pytest.fail(f"rank {STOPPED_RANK} never reached step 2: {job.communicate()[1]}")


@pytest.mark.slow
def test_a_stopped_rank_is_named_and_the_command_returns_within_the_timeout(
    tmp_path: Path,
) -> None:
    temp = tmp_path / "tmp"
    temp.mkdir()
    env = {**os.environ, "TMPDIR": str(temp), "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "engine.cli", *ARGS]
    job = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True)
    pid = _pid_once_training(temp, job, within_s=240)
    os.kill(pid, signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        _, err = job.communicate(timeout=120)
    finally:
        job.kill()
        if Path(f"/proc/{pid}").exists():
            os.kill(pid, signal.SIGKILL)
    took = time.monotonic() - stopped
    assert job.returncode == 1, err
    assert f"rank {STOPPED_RANK} (stage 0 of 2, dp replica 1) stopped responding" in err
    assert "during " in err and "killed once its peers gave up waiting" in err
    assert "Terminating process" not in err and "resource_tracker" not in err  # torch's noise
    leftovers = [p.name for p in temp.iterdir() if not p.name.startswith("torchinductor_")]
    assert leftovers == []  # no rank folder, no pytorch-errorfile-*.pickle (torch's cache stays)
    assert took < TIMEOUT_S + 5, f"returned {took:.1f} s after the stop"
