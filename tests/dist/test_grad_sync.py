"""The data-parallel gradient sum: what one process would have, on every replica."""

from __future__ import annotations

import torch
from torch import nn

from engine.comm.grad_sync import BucketedAllReduce
from engine.comm.mesh import init_mesh
from tests.dist.harness import run_ranks


def _reduce(rank: int, world_size: int) -> list[torch.Tensor | None]:
    mesh = init_mesh(1, 2, timeout_s=20)
    everywhere, on_rank_0, nowhere = (nn.Parameter(torch.zeros(3)) for _ in range(3))
    everywhere.grad = torch.full((3,), float(rank + 1))
    if rank == 0:
        on_rank_0.grad = torch.ones(3)
    reduce = BucketedAllReduce([everywhere, on_rank_0, nowhere], mesh.dp_group)
    reduce.start()
    reduce.finish()
    return [everywhere.grad, on_rank_0.grad, nowhere.grad]


def test_gradients_are_summed_and_one_no_replica_made_stays_none() -> None:
    for everywhere, on_rank_0, nowhere in run_ranks(_reduce, 2, timeout_s=60):
        assert everywhere is not None and torch.equal(everywhere, torch.full((3,), 3.0))
        assert on_rank_0 is not None and torch.equal(on_rank_0, torch.ones(3))
        assert nowhere is None
