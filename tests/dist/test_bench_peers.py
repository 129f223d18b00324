"""scripts/bench_peers.py runs every kind of system it compares and checks their losses."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.dist.harness import free_port

ROOT = Path(__file__).resolve().parents[2]


def test_each_launcher_runs_and_matches_the_reference(tmp_path: Path) -> None:
    pytest.importorskip("deepspeed", reason="deepspeed is not installed (pip install .[deepspeed])")
    systems = [
        "single-1t",
        "meshpipe-zb_drain",
        "torch-ScheduleDualPipeV",  # V-shaped: the last stage is on rank 0
        "deepspeed-PipelineEngine",
    ]
    command = [sys.executable, str(ROOT / "scripts" / "bench_peers.py"), "--model", "tiny",
               "--steps", "1", "--warmup", "1", "--work", str(tmp_path), "--port",
               str(free_port()), "--systems", ",".join(systems)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = {line.split(" | ")[0].strip("| *"): line for line in done.stdout.splitlines()}
    for system in systems:
        log = tmp_path / f"{system}.log"
        why = log.read_text()[-4000:] if log.exists() else done.stderr[-3000:]
        assert rows[system].endswith("| yes |"), f"{rows.get(system, done.stdout)}\n{why}"
