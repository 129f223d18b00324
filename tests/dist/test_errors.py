"""Bad layouts and broken peers fail fast with errors that name the problem."""

from __future__ import annotations

import os
import time

import pytest
import torch

from engine.comm.mesh import init_mesh
from engine.runtime.engine import PipelineEngine
from models import GPTConfig, layer_specs
from models.gpt import gpt_layers
from partitioners import Partition
from tests.dist.harness import RanksFailed, run_ranks

WIDE = GPTConfig(vocab_size=256, n_layer=2, n_head=4, d_model=64, max_seq_len=32)
NARROW = GPTConfig(vocab_size=256, n_layer=2, n_head=4, d_model=32, max_seq_len=32)


def _mismatched_stages(rank: int, world_size: int) -> None:
    """Stage 0 emits d_model 64; stage 1's blocks expect 32."""
    specs = gpt_layers(WIDE)[:3] + gpt_layers(NARROW)[1:]
    mesh = init_mesh(2, 1, timeout_s=20)
    engine = PipelineEngine(
        specs, mesh, partition=Partition(boundaries=(0, 3, 7)), micro_batches=2, timeout_s=20
    )
    tokens = torch.zeros(4, 8, dtype=torch.long)
    engine.train_step(tokens if engine.is_first else None, tokens if engine.is_last else None)


def _peer_dies(rank: int, world_size: int, wait_s: float = 0.0) -> None:
    """Rank 1 exits once the engine is built; rank 0 steps after `wait_s`."""
    mesh = init_mesh(2, 1, timeout_s=5)
    specs = layer_specs("gpt-tiny")
    engine = PipelineEngine(
        specs, mesh, partition=Partition(boundaries=(0, 3, 7)), micro_batches=2, timeout_s=5
    )
    if rank == 1:
        os._exit(0)
    time.sleep(wait_s)
    tokens = torch.zeros(4, 8, dtype=torch.long)
    engine.train_step(tokens, None)


_NAMED_DEAD_PEER = (
    r"(?s)rank 0.*(between stage [01] \(rank [01]\) and stage [01] \(rank [01]\)|with its "
    r"pipeline peers \[1\]) failed.*crashed, stalled or timed out"
)
"""Whichever exchange meets the dead peer first (a schedule's send or receive, or the step's
loss report), the error names it, the peer, and what likely happened."""


def test_stages_that_disagree_on_activation_shape_fail_on_the_first_step() -> None:
    start = time.monotonic()
    expected = r"(?s)stage 1 .*first layer GPTBlock.*shapes \[\(2, 8, 64\)\]"
    with pytest.raises(RanksFailed, match=expected):
        run_ranks(_mismatched_stages, 2, timeout_s=60)
    assert time.monotonic() - start < 45


def test_a_dead_peer_raises_instead_of_hanging() -> None:
    start = time.monotonic()
    with pytest.raises(RanksFailed, match=_NAMED_DEAD_PEER):
        run_ranks(_peer_dies, 2, timeout_s=60)
    assert time.monotonic() - start < 45


def test_a_peer_dead_before_the_step_is_named_too() -> None:
    """gloo refuses to post a transfer to a peer whose connection is already closed: that
    refusal is named like a failed transfer, not left as gloo's bare error."""
    with pytest.raises(RanksFailed, match=_NAMED_DEAD_PEER):
        run_ranks(_peer_dies, 2, 2.0, timeout_s=60)


def test_pp_times_dp_times_tp_must_equal_the_world_size(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "4")
    match = r"pp × dp × tp = 2 × 3 × 1 = 6 does not match the world size 4"
    with pytest.raises(ValueError, match=match):
        init_mesh(2, 3)


def _refused_then_good(rank: int, world_size: int) -> tuple[float, float]:
    mesh = init_mesh(2, 1, timeout_s=20)
    specs = layer_specs("gpt-tiny")
    partition = Partition(boundaries=(0, 3, 7))

    def engine() -> PipelineEngine:
        return PipelineEngine(specs, mesh, partition=partition, micro_batches=4, timeout_s=20)

    tokens = torch.randint(0, 256, (8, 9), generator=torch.Generator().manual_seed(0))
    with engine() as refusing:
        with pytest.raises(ValueError, match="does not split into 4"):
            refusing.train_step(tokens[:6, :-1], tokens[:6, 1:])
        retried = refusing.train_step(tokens[:, :-1], tokens[:, 1:]).loss
    with engine() as fresh:
        first = fresh.train_step(tokens[:, :-1], tokens[:, 1:]).loss
    return retried, first


def test_a_refused_batch_leaves_the_pipeline_ready_for_the_next_step() -> None:
    results = run_ranks(_refused_then_good, 2, timeout_s=90)
    for retried, first in results:
        assert retried == first


def _open_fds_per_engine(rank: int, world_size: int) -> list[int]:
    mesh = init_mesh(2, 1, timeout_s=20)
    specs = layer_specs("gpt-tiny")
    tokens = torch.zeros(4, 9, dtype=torch.long)
    counts = []
    for _ in range(4):
        with PipelineEngine(
            specs, mesh, partition=Partition(boundaries=(0, 3, 7)), micro_batches=2
        ) as engine:
            engine.train_step(tokens[:, :-1], tokens[:, 1:])
        counts.append(len(os.listdir("/proc/self/fd")))
    return counts


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts open files in /proc")
def test_closing_an_engine_releases_its_process_groups() -> None:
    for counts in run_ranks(_open_fds_per_engine, 2, timeout_s=120):
        assert counts[-1] <= counts[0], counts  # without close: about 20 more per engine


def _replica_dies(rank: int, world_size: int) -> None:
    mesh = init_mesh(1, 2, timeout_s=5)
    specs = layer_specs("gpt-tiny")
    engine = PipelineEngine(
        specs, mesh, partition=Partition(boundaries=(0, 7)), micro_batches=2, timeout_s=5
    )
    if rank == 1:
        os._exit(0)
    tokens = torch.zeros(4, 9, dtype=torch.long)
    engine.train_step(tokens[:, :-1], tokens[:, 1:])


def test_a_dead_data_parallel_peer_is_named_in_the_error() -> None:
    with pytest.raises(RanksFailed, match=r"rank 0: the loss's data-parallel mean failed"):
        run_ranks(_replica_dies, 2, timeout_s=60)
