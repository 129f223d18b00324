"""scripts/bench_commits.py: one training command at a base commit and in the working tree,
round by round, with the paired ratio and both final losses; the base's worktree removed."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "bench_commits.py"
TRAIN = ["--model", "gpt-tiny", "--global-batch", "4", "--seq-len", "16", "--steps", "2"]
TRAIN += ["--threads", "1"]
pytestmark = pytest.mark.skipif(
    not (ROOT / ".git").exists(), reason="compares commits: needs the repository's git checkout"
)


def _worktrees() -> list[str]:
    listed = subprocess.run(
        ["git", "-C", str(ROOT), "worktree", "list"], capture_output=True, text=True, check=True
    )
    return listed.stdout.splitlines()


def test_each_round_prints_both_sides_their_ratio_and_their_losses() -> None:
    before = _worktrees()
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--base", "HEAD", "--rounds", "2", "--", *TRAIN],
        capture_output=True, text=True, check=True, cwd=ROOT,
    )  # fmt: skip
    rows = [line for line in done.stdout.splitlines() if re.match(r"[12] ", line)]
    assert len(rows) == 2
    for row in rows:
        base, new, ratio = re.findall(r"[\d,.]+", row)[1:4]
        assert float(ratio) == round(float(new.replace(",", "")) / float(base.replace(",", "")), 3)
        assert re.search(r"\d\.\d{4} / \d\.\d{4}$", row)  # both final losses
    assert "median new ÷ base over 2 rounds" in done.stdout
    assert _worktrees() == before  # the base's worktree is gone


def test_without_train_flags_it_says_what_to_give() -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--base", "HEAD"], capture_output=True, text=True, cwd=ROOT
    )
    assert done.returncode == 2 and "after --, meshpipe train's flags" in done.stderr
