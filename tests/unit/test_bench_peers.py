"""scripts/bench_peers.py's table (the loss column says what it compared against) and which
systems its driver runs where."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from scripts.bench_results import census_lines, paired, table_row

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
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_a_run_without_the_single_process_reference_says_so() -> None:
    row = table_row("meshpipe-1f1b", RANKS, 4096, 8192.0, [])
    assert row.endswith("| – (no single-1t in this run) |")


def test_losses_within_tolerance_of_the_reference_match() -> None:
    assert table_row("x", RANKS, 4096, 8192.0, [5.0, 4.0002]).endswith("| yes |")


def test_losses_off_the_reference_do_not_match() -> None:
    assert table_row("x", RANKS, 4096, 8192.0, [5.0, 4.1]).endswith("| NO |")


def test_the_slowest_rank_sets_the_step_time() -> None:
    assert "| 0.600 | 6,827 |" in table_row("x", RANKS, 4096, 8192.0, [])


def test_each_rank_s_cpu_time_per_step_is_a_column() -> None:
    assert "| 0.400, 0.450 | 500, 510 |" in table_row("x", RANKS, 4096, 8192.0, [])


def test_rounds_are_paired_by_wall_time_and_by_every_rank_s_cpu_time() -> None:
    theirs = [dict(rank, step_s=1.2, cpu_s=1.0) for rank in RANKS]
    rounds = {"meshpipe-zb_v": [RANKS], "torch-ScheduleZBVZeroBubble": [theirs]}
    ok = {name: runs[0] for name, runs in rounds.items()}
    wall, cpu = paired(rounds, ok)
    assert wall.endswith("s/step, paired by round: 2.000 (median 2.000×)")
    assert cpu.endswith("CPU s/step of all ranks, paired by round: 2.353 (median 2.353×)")


def test_the_census_lists_the_ops_whose_calls_or_bytes_differ() -> None:
    ours = {"aten.mm.default": [4, 2**20], "aten.detach.default": [3, 0]}
    theirs = {"aten.mm.default": [4, 2**20], "aten.div_.Tensor": [2, 2**21]}
    ok = {
        "meshpipe-zb_v": [dict(RANKS[0], census=ours)],
        "torch-ScheduleZBVZeroBubble": [dict(RANKS[0], census=theirs)],
    }
    lines = census_lines(ok)
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


def test_a_rank_s_gpu_peak_is_its_memory_column_when_it_used_a_gpu() -> None:
    on_gpus = [dict(rank, gpu_mib=1200.0 + 100 * i) for i, rank in enumerate(RANKS)]
    assert "| 0.400, 0.450 | 1200, 1300 |" in table_row("x", on_gpus, 4096, 8192.0, [])


def test_cuda_offers_only_the_systems_that_run_on_gpus(bench: ModuleType, tmp_path: Path) -> None:
    args = bench._parser().parse_args(["--device", "cuda"])
    commands = bench._commands(args, tmp_path)
    assert not set(commands) & set(bench.CPU_ONLY)
    assert {"single-1t", "meshpipe-zb_v", "torch-ScheduleZBVZeroBubble"} <= set(commands)
    assert all(command[command.index("--device") + 1] == "cuda" for command in commands.values())


def test_cuda_on_fewer_than_two_gpus_is_refused_before_anything_is_prepared(
    bench: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(bench.torch.cuda, "device_count", lambda: 1)
    argv = ["bench_peers.py", "--device", "cuda", "--work", str(tmp_path), "--model", "tiny"]
    monkeypatch.setattr(bench.sys, "argv", argv)
    with pytest.raises(SystemExit, match="on 2 GPUs .* this machine has 1"):
        bench.main()
    assert not (tmp_path / "weights.safetensors").exists()


def test_a_cpu_only_system_asked_for_under_cuda_is_refused_by_name(
    bench: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(bench.torch.cuda, "device_count", lambda: 2)
    args = bench._parser().parse_args(["--device", "cuda", "--systems", "single-1t,single-2t"])
    with pytest.raises(SystemExit, match=r"single-2t runs on the CPU only \(--device cpu\)"):
        bench._chosen(args, bench._commands(args, tmp_path))


def test_an_unknown_system_is_refused_by_name(bench: ModuleType, tmp_path: Path) -> None:
    args = bench._parser().parse_args(["--systems", "meshpipe-zbv"])
    with pytest.raises(SystemExit, match="meshpipe-zbv unknown or not installed"):
        bench._chosen(args, bench._commands(args, tmp_path))


def test_one_gpu_runs_a_one_rank_pipeline(
    bench: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(bench.torch.cuda, "device_count", lambda: 1)
    systems = "meshpipe-zb_v,torch-ScheduleZBVZeroBubble"
    args = bench._parser().parse_args(["--device", "cuda", "--ranks", "1", "--systems", systems])
    commands = bench._commands(args, tmp_path)
    assert bench._chosen(args, commands) == ["meshpipe-zb_v", "torch-ScheduleZBVZeroBubble"]
    command = commands["meshpipe-zb_v"]
    assert command[command.index("--nproc-per-node") + 1] == "1"


def test_a_two_stage_peer_asked_for_on_other_rank_counts_is_refused_by_name(
    bench: ModuleType, tmp_path: Path
) -> None:
    args = bench._parser().parse_args(["--ranks", "4", "--systems", "deepspeed-PipelineEngine"])
    with pytest.raises(SystemExit, match=r"deepspeed-PipelineEngine runs on two ranks only"):
        bench._chosen(args, bench._commands(args, tmp_path))


def test_each_rank_s_page_faults_per_step_are_a_column_in_thousands() -> None:
    faulting = [dict(rank, faults=12_345) for rank in RANKS]
    assert "| 500, 510 | 12.3, 12.3 |" in table_row("x", faulting, 4096, 8192.0, [])
    assert "| 500, 510 | –, – |" in table_row("x", RANKS, 4096, 8192.0, [])


@pytest.mark.parametrize("malloc", ["glibc", "keep"])
def test_the_allocator_setting_reaches_every_system_s_processes(
    bench: ModuleType, tmp_path: Path, malloc: str
) -> None:
    args = bench._parser().parse_args(["--malloc", malloc])
    show = "import os; print(os.environ.get('MALLOC_TRIM_THRESHOLD_'))"
    bench._run("probe", [sys.executable, "-c", show], tmp_path, args)
    expected = "1073741824" if malloc == "keep" else "None"
    assert (tmp_path / "probe.log").read_text().strip() == expected


def test_each_meshpipe_schedule_is_paired_with_torch_s_same_schedule() -> None:
    slower = [dict(rank, step_s=rank["step_s"] * 1.1) for rank in RANKS]
    rounds = {
        "meshpipe-zb_v": [slower],
        "torch-ScheduleZBVZeroBubble": [RANKS],
        "meshpipe-dualpipe_v": [RANKS],
        "torch-ScheduleDualPipeV": [slower],
    }
    lines = paired(rounds, {name: runs[0] for name, runs in rounds.items()})
    walls = [line for line in lines if ", s/step," in line]
    assert walls == [
        "- torch-ScheduleZBVZeroBubble ÷ meshpipe-dualpipe_v, s/step, paired by round: 1.000 "
        "(median 1.000×)",
        "- torch-ScheduleZBVZeroBubble ÷ meshpipe-zb_v, s/step, paired by round: 0.909 "
        "(median 0.909×)",
        "- torch-ScheduleDualPipeV ÷ meshpipe-dualpipe_v, s/step, paired by round: 1.100 "
        "(median 1.100×)",
    ]
