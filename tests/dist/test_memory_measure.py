"""`meshpipe memory --measure` replays one rank's step against torch's fake process group,
whose collectives return without peers or data. Here the same measurement runs on two real
gloo ranks (FSDP2's gathers and reduce-scatters and DTensor's collectives really travel), and
rank 0's tracker sees what the fake world saw, byte for byte. (Memory a backend allocates in
C++, outside op dispatch, is seen by neither.)"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from engine.memory.estimate import MemoryConfig
from engine.memory.fake_world import stage_grid
from engine.memory.measure import measure_memory
from engine.memory.settled import SettledAllGather, SettledReduceScatter, settle_collectives
from engine.memory.tracker import MemoryTracker
from tests.dist.harness import run_ranks

CASES: list[dict[str, Any]] = [
    {"dp": 2, "zero": 3},
    {"tp": 2},
    {"dp": 2, "zero": 2},
    {"dp": 2, "zero": 1},
    {"dp": 2, "zero": 0, "precision": "fp32"},
]
"""FSDP2 (ZeRO-3), DTensor (tp), the engine's `ShardedOptimizer` (ZeRO-1/2) and its bucketed
all-reduce (ZeRO-0)."""


def _config(changes: dict[str, Any]) -> MemoryConfig:
    base: dict[str, Any] = {"model": "llama-tiny", "micro_batches": 2, "seq_len": 16}
    base |= {"precision": "bf16", "optimizer_impl": "per_tensor", "device": "cpu"}
    return MemoryConfig.of(**{**base, **changes})


def _measure_all(rank: int, world_size: int) -> list[Any]:
    dist.init_process_group("gloo")
    return [measure_memory(_config(c)) for c in CASES]


@pytest.fixture(scope="module")
def on_gloo() -> list[Any]:
    return list(run_ranks(_measure_all, 2, timeout_s=240)[0])


@pytest.mark.parametrize(
    "index", range(len(CASES)), ids=["zero3", "tp2", "zero2", "zero1", "zero0"]
)
def test_one_ranks_measured_step_on_gloo_equals_the_fake_worlds(
    index: int, on_gloo: list[Any]
) -> None:
    fake = measure_memory(_config(CASES[index]))
    real = on_gloo[index]
    assert real.stages == fake.stages
    assert real.rank_peaks == fake.rank_peaks


def _settled_collectives(rank: int, world_size: int) -> dict[str, Any]:
    """Each settled collective under a tracker: what it wrote, and the bytes counted after it
    (live, peak)."""
    dist.init_process_group("gloo")
    cpu = torch.device("cpu")
    with MemoryTracker() as tracker:
        gathered = SettledAllGather().allocate((4,), dtype=torch.float32, device=cpu)
        SettledAllGather()(gathered, torch.full((2,), float(rank)), dist.group.WORLD)
        after_gather = (tracker.live, tracker.peak)
        shard = SettledReduceScatter().allocate((2,), dtype=torch.float32, device=cpu)
        full = torch.arange(float(rank), rank + 4.0)
        SettledReduceScatter()(shard, full, dist.group.WORLD, dist.ReduceOp.SUM)
        after_scatter = (tracker.live, tracker.peak)
    return {
        "gathered": gathered.tolist(),
        "after_gather": after_gather,
        "shard": shard.tolist(),
        "after_scatter": after_scatter,
        "settled": settle_collectives([], dist.group.WORLD),
    }


@pytest.fixture(scope="module")
def settled() -> list[dict[str, Any]]:
    return list(run_ranks(_settled_collectives, 2, timeout_s=120))


def test_a_settled_all_gather_fills_fsdp_s_buffer(settled: list[dict[str, Any]]) -> None:
    assert [r["gathered"] for r in settled] == [[0.0, 0.0, 1.0, 1.0]] * 2


def test_a_settled_reduce_scatter_fills_each_rank_s_shard(settled: list[dict[str, Any]]) -> None:
    assert [r["shard"] for r in settled] == [[1.0, 3.0], [5.0, 7.0]]


def test_the_backend_s_copies_are_never_counted(settled: list[dict[str, Any]]) -> None:
    """Counted: FSDP's buffers and the inputs made here, live while they are used (gathered
    16 B with its 8 B input, then 8 B of shard with its 16 B input); the copies the backend
    holds, and may free on its own thread, never."""
    expected = [((16, 24), (40, 40))] * 2
    assert [(r["after_gather"], r["after_scatter"]) for r in settled] == expected


def test_collectives_are_settled_on_gloo_and_left_as_fsdp_s_on_the_fake_world(
    settled: list[dict[str, Any]],
) -> None:
    with stage_grid(2, 1, fsdp=True) as grid:
        assert grid.dp_group is not None
        on_fake = settle_collectives([], grid.dp_group)
    assert (on_fake, [r["settled"] for r in settled]) == (False, [True, True])
