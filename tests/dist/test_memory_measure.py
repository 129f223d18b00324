"""`meshpipe memory --measure` replays one rank's step against torch's fake process group,
whose collectives return without peers or data. Here the same measurement runs on two real
gloo ranks (FSDP2's gathers and reduce-scatters and DTensor's collectives really travel), and
rank 0's tracker sees what the fake world saw, byte for byte. (Memory a backend allocates in
C++, outside op dispatch, is seen by neither.)"""

from __future__ import annotations

from typing import Any

import pytest
import torch.distributed as dist

from engine.memory.estimate import MemoryConfig
from engine.memory.measure import measure_memory
from tests.dist.harness import run_ranks

CASES: list[dict[str, Any]] = [{"dp": 2, "zero": 3}, {"tp": 2}]


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


@pytest.mark.parametrize("index", range(len(CASES)), ids=["zero3", "tp2"])
def test_one_ranks_measured_step_on_gloo_equals_the_fake_worlds(
    index: int, on_gloo: list[Any]
) -> None:
    fake = measure_memory(_config(CASES[index]))
    real = on_gloo[index]
    assert real.stages == fake.stages
    assert real.rank_peaks == fake.rank_peaks
