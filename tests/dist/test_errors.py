"""Bad layouts and broken peers fail fast with errors that name the problem."""

from __future__ import annotations

import os
import time

import pytest
import torch

from engine.engine import PipelineEngine
from engine.mesh import init_mesh
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


def _peer_dies(rank: int, world_size: int) -> None:
    mesh = init_mesh(2, 1, timeout_s=5)
    specs = layer_specs("gpt-tiny")
    engine = PipelineEngine(
        specs, mesh, partition=Partition(boundaries=(0, 3, 7)), micro_batches=2, timeout_s=5
    )
    if rank == 1:
        os._exit(0)
    tokens = torch.zeros(4, 8, dtype=torch.long)
    engine.train_step(tokens, None)


def test_stages_that_disagree_on_activation_shape_fail_on_the_first_step() -> None:
    start = time.monotonic()
    with pytest.raises(RanksFailed, match=r"(?s)stage 1 .*first layer GPTBlock.*shapes \[\(2, 8, 64\)\]"):
        run_ranks(_mismatched_stages, 2, timeout_s=60)
    assert time.monotonic() - start < 45


def test_a_dead_peer_raises_instead_of_hanging() -> None:
    start = time.monotonic()
    with pytest.raises(RanksFailed, match=r"(?s)rank 0 failed at action .*between stage"):
        run_ranks(_peer_dies, 2, timeout_s=60)
    assert time.monotonic() - start < 45


def test_pp_times_dp_must_equal_the_world_size(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ValueError, match=r"pp × dp = 2 × 3 = 6 does not match the world size 4"):
        init_mesh(2, 3)
