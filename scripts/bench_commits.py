"""One `meshpipe train` command at two commits, side by side: what a change bought.

The base commit is checked out in a temporary git worktree; each round runs the command there
and then in this working tree (the order alternating by round, so neither side always runs
on a warmer machine), and the table gives each round's tokens/s, the paired ratio new ÷ base
and their median. Both sides print their final loss: a change meant to be exact must leave
it as it was.

    PYTHONPATH=$PWD python scripts/bench_commits.py --base HEAD~1 --rounds 5 -- \\
        --model gpt-bench --tp 2 --global-batch 16 --micro-batches 8 --seq-len 128 \\
        --steps 6 --threads 1
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
_TOKENS = re.compile(r"\(([\d,.]+) tokens/s")
_LOSS = re.compile(r"final loss ([\d.]+)")


def _run(tree: Path, train: list[str]) -> tuple[float, str]:
    """(tokens/s, final loss) of `meshpipe train` run from `tree`'s code."""
    command = [sys.executable, "-m", "engine.cli", "train", *train, "--no-progress"]
    done = subprocess.run(
        command, cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)},
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    out = done.stdout + done.stderr
    tokens, loss = _TOKENS.findall(out), _LOSS.findall(out)
    if done.returncode or not tokens:
        raise SystemExit(f"{tree}: meshpipe train failed ({done.returncode}):\n{out[-2000:]}")
    return float(tokens[-1].replace(",", "")), loss[-1] if loss else "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="the commit to compare against")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("train", nargs=argparse.REMAINDER, help="-- then meshpipe train's flags")
    args = parser.parse_args()
    train = args.train[1:] if args.train[:1] == ["--"] else args.train
    if args.rounds < 1 or not train:
        parser.error("give --rounds of 1 or more and, after --, meshpipe train's flags")
    with tempfile.TemporaryDirectory() as folder:
        base = Path(folder) / "base"
        subprocess.run(
            ["git", "-C", str(_ROOT), "worktree", "add", "--detach", "-q", str(base), args.base],
            check=True,
        )
        try:
            _rounds(base, args.rounds, train)
        finally:
            subprocess.run(["git", "-C", str(_ROOT), "worktree", "remove", "--force", str(base)])


def _rounds(base: Path, rounds: int, train: list[str]) -> None:
    columns = f"{'round':<6} {'base tokens/s':>14} {'new tokens/s':>13} {'new ÷ base':>11}"
    print(columns + "   final loss (base / new)")
    ratios = []
    for r in range(1, rounds + 1):
        sides = [("base", base), ("new", _ROOT)]
        got = dict((name, _run(tree, train)) for name, tree in sides[:: 1 if r % 2 else -1])
        (old, old_loss), (new, new_loss) = got["base"], got["new"]
        ratios.append(new / old)
        print(f"{r:<6} {old:>14,.0f} {new:>13,.0f} {new / old:>10.3f}×   {old_loss} / {new_loss}")
    print(f"median new ÷ base over {rounds} rounds: {statistics.median(ratios):.3f}×")


if __name__ == "__main__":
    main()
