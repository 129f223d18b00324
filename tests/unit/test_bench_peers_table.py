"""scripts/bench_peers.py's table: the loss column says what it compared against."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_peers.py"
RANKS = [
    {"step_s": 0.5, "cpu_s": 0.4, "losses": [5.0, 4.0], "rss_mib": 500.0, "bubble": None},
    {"step_s": 0.6, "cpu_s": 0.45, "losses": [5.0, 4.0], "rss_mib": 510.0, "bubble": None},
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


def test_each_rank_s_cpu_time_per_step_is_a_column(bench: ModuleType) -> None:
    assert "| 0.400, 0.450 | 500, 510 |" in bench._row("x", RANKS, 4096, 8192.0, [])


def test_rounds_are_paired_by_wall_time_and_by_every_rank_s_cpu_time(bench: ModuleType) -> None:
    theirs = [dict(rank, step_s=1.2, cpu_s=1.0) for rank in RANKS]
    rounds = {"meshpipe-zb_v": [RANKS], "torch-ScheduleZBVZeroBubble": [theirs]}
    ok = {name: runs[0] for name, runs in rounds.items()}
    wall, cpu = bench._paired(rounds, ok)
    assert wall.endswith("s/step, paired by round: 2.000 (median 2.000×)")
    assert cpu.endswith("CPU s/step of all ranks, paired by round: 2.353 (median 2.353×)")


def test_the_census_lists_the_ops_whose_calls_or_bytes_differ(bench: ModuleType) -> None:
    ours = {"aten.mm.default": [4, 2**20], "aten.detach.default": [3, 0]}
    theirs = {"aten.mm.default": [4, 2**20], "aten.div_.Tensor": [2, 2**21]}
    ok = {
        "meshpipe-zb_v": [dict(RANKS[0], census=ours)],
        "torch-ScheduleZBVZeroBubble": [dict(RANKS[0], census=theirs)],
    }
    lines = bench._census_lines(ok)
    assert lines[1] == "  - rank 0: 1 ops alike (4 calls); differing:"
    assert lines[2:] == [
        "    - aten.detach.default: 3 vs 0 calls, 0.0 vs 0.0 MiB",
        "    - aten.div_.Tensor: 0 vs 2 calls, 0.0 vs 2.0 MiB",
    ]


def test_the_census_counts_the_ops_one_call_dispatches(bench: ModuleType) -> None:
    import torch

    counts = bench._census(lambda: (torch.ones(4, 4) @ torch.ones(4, 4)).t())
    assert counts["aten.mm.default"] == [1, 64]
    assert counts["aten.t.default"] == [1, 0]  # a view allocates nothing
