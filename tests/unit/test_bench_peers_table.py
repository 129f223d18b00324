"""scripts/bench_peers.py's table: the loss column says what it compared against."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_peers.py"
RANKS = [
    {"step_s": 0.5, "losses": [5.0, 4.0], "rss_mib": 500.0, "bubble": None},
    {"step_s": 0.6, "losses": [5.0, 4.0], "rss_mib": 510.0, "bubble": None},
]


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_peers", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_run_without_the_single_process_reference_says_so(bench: ModuleType) -> None:
    row = bench._row("meshpipe-1f1b", RANKS, 4096, 8192.0, [])
    assert row.endswith("| – (no single-1t in this run) |")


def test_losses_within_tolerance_of_the_reference_match(bench: ModuleType) -> None:
    assert bench._row("x", RANKS, 4096, 8192.0, [5.0, 4.0002]).endswith("| yes |")


def test_losses_off_the_reference_do_not_match(bench: ModuleType) -> None:
    assert bench._row("x", RANKS, 4096, 8192.0, [5.0, 4.1]).endswith("| NO |")


def test_the_slowest_rank_sets_the_step_time(bench: ModuleType) -> None:
    assert "| 0.600 | 6,827 |" in bench._row("x", RANKS, 4096, 8192.0, [])
