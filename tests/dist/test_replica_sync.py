"""Semi-synchronous data parallelism (local SGD, DiLoCo) on pp 2 × dp 2: what the algorithms
promise, against every-step sync on the same four ranks, all runs in one launch.

Plain SGD (no momentum, no weight decay) makes one local step and an average of the weights
the same update as a step on the averaged gradients, up to the order of float sums.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from engine.comm.mesh import init_mesh
from engine.config import OptimizerSpec, ReplicaSync
from engine.runtime.engine import PipelineEngine
from models import layer_specs
from partitioners import partition_model
from tests.dist.harness import run_ranks

SEQ_LEN, ROWS, STEPS = 8, 4, 2
SYNCS = {
    "every-step": ReplicaSync(),
    "local-sgd H=1": ReplicaSync(dp_sync="local-sgd"),
    "diloco H=1 lr=1 m=0": ReplicaSync(dp_sync="diloco", outer_lr=1.0, outer_momentum=0.0),
    "diloco H=2": ReplicaSync(dp_sync="diloco", sync_every=2),
    "local-sgd H=3": ReplicaSync(dp_sync="local-sgd", sync_every=3),
}


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, 256, (ROWS, SEQ_LEN + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def _train(sync: ReplicaSync) -> dict[str, Any]:
    mesh = init_mesh(2, 2, timeout_s=60)
    specs = list(layer_specs("gpt-tiny"))
    partition = partition_model(specs, method="uniform", num_stages=2, seq_len=SEQ_LEN)
    engine = PipelineEngine(
        specs,
        mesh,
        partition=partition,
        micro_batches=2,
        seed=3,
        optimizer=OptimizerSpec(name="sgd", lr=0.5, weight_decay=0.0, momentum=0.0),
        timeout_s=60,
        replica_sync=sync,
    )
    rows = slice(mesh.dp_rank * ROWS // 2, (mesh.dp_rank + 1) * ROWS // 2)
    for step in range(STEPS):
        inputs, targets = _batch(step)
        engine.train_step(inputs[rows], targets[rows])
    params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    engine.close()
    return {"pp": mesh.pp_rank, "dp": mesh.dp_rank, "params": params}


def _all(rank: int, world_size: int) -> dict[str, dict[str, Any]]:
    return {name: _train(sync) for name, sync in SYNCS.items()}


@pytest.fixture(scope="module")
def runs() -> dict[str, list[dict[str, Any]]]:
    per_rank = run_ranks(_all, 4, timeout_s=300)
    return {name: [rank[name] for rank in per_rank] for name in SYNCS}


def _replica(ranks: list[dict[str, Any]], dp: int) -> dict[str, torch.Tensor]:
    """One replica's parameters, both stages'."""
    return {n: t for r in ranks if r["dp"] == dp for n, t in r["params"].items()}


def _close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-6, msg=name)


def test_local_sgd_every_step_with_plain_sgd_equals_every_step_sync(runs: Any) -> None:
    _close(_replica(runs["local-sgd H=1"], 0), _replica(runs["every-step"], 0))


def test_diloco_with_outer_lr_1_and_no_momentum_every_step_equals_local_sgd(runs: Any) -> None:
    _close(_replica(runs["diloco H=1 lr=1 m=0"], 0), _replica(runs["local-sgd H=1"], 0))


@pytest.mark.parametrize("name", ["diloco H=2", "local-sgd H=1"])
def test_replicas_hold_equal_parameters_right_after_a_meeting(runs: Any, name: str) -> None:
    first, second = _replica(runs[name], 0), _replica(runs[name], 1)
    assert all(torch.equal(first[n], second[n]) for n in first)


def test_replicas_differ_between_meetings(runs: Any) -> None:
    first, second = _replica(runs["local-sgd H=3"], 0), _replica(runs["local-sgd H=3"], 1)
    assert any(not torch.equal(first[n], second[n]) for n in first)
