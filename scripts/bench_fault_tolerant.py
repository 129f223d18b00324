"""--fault-tolerant under a real kill -9: the final loss of a run one of whose ranks is SIGKILLed
from outside, against the same run uninterrupted, with the steps the dead replica missed.

Both runs are `meshpipe train --fault-tolerant` processes. Once the killed run's metrics file
holds `--kill-after` steps, this script sends SIGKILL to the last rank process the launcher
started (the last rank of the last replica) and lets the run finish; nothing in the run knows
it is coming. Printed: a markdown row per run (final loss, wall seconds, relaunches, missed
steps) from the launcher's own report.

python scripts/bench_fault_tolerant.py --model gpt-tiny --pp 1 --dp 2 --steps 60 --kill-after 20
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]


def _command(args: argparse.Namespace, metrics: Path) -> list[str]:
    return [
        sys.executable, "-m", "engine.cli", "train", "--model", args.model,
        "--pp", str(args.pp), "--dp", str(args.dp), "--steps", str(args.steps),
        "--seq-len", "64", "--global-batch", "8", "--micro-batches", "2",
        "--fault-tolerant", "--max-restarts", "1", "--no-progress",
        "--metrics-file", str(metrics), "--timeout", "120",
    ]  # fmt: skip


def _ranks(launcher: psutil.Process) -> list[psutil.Process]:
    """The launcher's rank processes (spawned children), oldest first."""
    lines = {child: " ".join(child.cmdline()) for child in launcher.children(recursive=True)}
    ranks = [child for child, line in lines.items() if "spawn_main" in line]
    return sorted(ranks, key=lambda child: child.create_time())


def _steps_done(metrics: Path) -> int:
    return len(metrics.read_text().splitlines()) if metrics.is_file() else 0


def _run(args: argparse.Namespace, *, kill_after: int | None) -> dict[str, object]:
    folder = Path(tempfile.mkdtemp(prefix="bench-ft-"))
    metrics = folder / "metrics.jsonl"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    start = time.perf_counter()
    launcher = subprocess.Popen(
        _command(args, metrics), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    killed = None
    if kill_after is not None:
        while _steps_done(metrics) < kill_after and launcher.poll() is None:
            time.sleep(0.05)
        victim = _ranks(psutil.Process(launcher.pid))[-1]
        os.kill(victim.pid, signal.SIGKILL)
        killed = _steps_done(metrics)
    out, err = launcher.communicate()
    seconds = time.perf_counter() - start
    if launcher.returncode != 0:
        raise SystemExit(f"run failed ({launcher.returncode}):\n{err}")
    final = re.search(r"final loss ([0-9.]+)", out)
    missed = re.search(r"missed (\d+) steps \(healed", err)
    return {
        "final_loss": float(final.group(1)) if final else float("nan"),
        "seconds": seconds,
        "killed_after": killed,
        "missed": int(missed.group(1)) if missed else 0,
        "relaunched": "relaunched" in err,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="gpt-tiny")
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--kill-after", type=int, default=20)
    args = parser.parse_args()
    rows = [("uninterrupted", _run(args, kill_after=None))]
    rows.append((f"kill -9 after step {args.kill_after}", _run(args, kill_after=args.kill_after)))
    print("| run | final loss | wall s | relaunched | steps missed |")
    print("| --- | --- | --- | --- | --- |")
    for name, row in rows:
        print(
            f"| {name} | {row['final_loss']:.4f} | {row['seconds']:.1f} | "
            f"{'yes' if row['relaunched'] else 'no'} | {row['missed']} |"
        )


if __name__ == "__main__":
    main()
