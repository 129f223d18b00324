"""Semi-synchronous data parallelism (local SGD, DiLoCo) and the parameter server on pp 2 ×
dp 2: what the algorithms promise, against every-step sync on the same four ranks, all runs in
one launch.

Plain SGD (no momentum, no weight decay) makes one local step and an average of the weights
the same update as a step on the averaged gradients, up to the order of float sums. A
parameter server with K = 0 steps the mean of the replicas' gradients before any replica
computes the next step: every-step sync, up to the order of float sums.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from engine.checkpoint import TrainerState, load_checkpoint, save_checkpoint
from engine.checkpoint.files import TensorReader
from engine.checkpoint.outer_state import OUTER_INDEX
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
    "ps K=0": ReplicaSync(dp_sync="parameter-server"),
    "ps K=1": ReplicaSync(dp_sync="parameter-server", max_staleness=1),
}
RESUMED = ReplicaSync(dp_sync="diloco", sync_every=2, outer_momentum=0.9)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, 256, (ROWS, SEQ_LEN + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


@contextlib.contextmanager
def _counting_exchanges(group: Any) -> Iterator[list[int]]:
    """Counts the all-reduces this rank makes over `group` inside the block."""
    calls, real = [0], dist.all_reduce

    def all_reduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        calls[0] += kwargs.get("group") is group
        return real(tensor, *args, **kwargs)

    dist.all_reduce = all_reduce  # type: ignore[assignment]
    try:
        yield calls
    finally:
        dist.all_reduce = real


def _engine(sync: ReplicaSync) -> PipelineEngine:
    specs = list(layer_specs("gpt-tiny"))
    return PipelineEngine(
        specs,
        init_mesh(2, 2, timeout_s=60),
        partition=partition_model(specs, method="uniform", num_stages=2, seq_len=SEQ_LEN),
        micro_batches=2,
        seed=3,
        optimizer=OptimizerSpec(name="sgd", lr=0.5, weight_decay=0.0, momentum=0.0),
        timeout_s=60,
        replica_sync=sync,
    )


def _steps(engine: PipelineEngine, steps: range) -> dict[str, torch.Tensor]:
    """Train `steps` on this replica's rows; the parameters after them."""
    dp = engine.mesh.dp_rank
    rows = slice(dp * ROWS // 2, (dp + 1) * ROWS // 2)
    for step in steps:
        inputs, targets = _batch(step)
        engine.train_step(inputs[rows], targets[rows])
    return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def _train(sync: ReplicaSync) -> dict[str, Any]:
    engine = _engine(sync)
    with _counting_exchanges(engine.mesh.dp_group) as dp_exchanges:
        params = _steps(engine, range(STEPS))
    server = engine.param_server
    engine.close()
    return {
        "dp": engine.mesh.dp_rank,
        "params": params,
        "dp_exchanges": dp_exchanges[0],
        "staleness": server.staleness if server is not None else [],
        "bytes_per_step": server.bytes_per_step if server is not None else 0.0,
        "server_bytes": server.server_bytes() if server is not None else 0,
    }


def _resume(root: str) -> dict[str, Any]:
    """DiLoCo (H=2, outer momentum) for 4 steps, saved after 2; a fresh engine loads that
    checkpoint and runs steps 3 and 4."""
    specs = list(layer_specs("gpt-tiny"))
    with _engine(RESUMED) as uninterrupted:
        _steps(uninterrupted, range(2))
        save_checkpoint(uninterrupted, specs, root, state=TrainerState(step=2))
        straight = _steps(uninterrupted, range(2, 4))
    with _engine(RESUMED) as resumed:
        load_checkpoint(resumed, specs, root)
        again = _steps(resumed, range(2, 4))
    return {"dp": resumed.mesh.dp_rank, "uninterrupted": straight, "resumed": again}


def _all(rank: int, world_size: int, root: str) -> dict[str, dict[str, Any]]:
    return {**{name: _train(sync) for name, sync in SYNCS.items()}, "resume": _resume(root)}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("checkpoints")


@pytest.fixture(scope="module")
def runs(checkpoints: Path) -> dict[str, list[dict[str, Any]]]:
    per_rank = run_ranks(_all, 4, str(checkpoints), timeout_s=300)
    return {name: [rank[name] for rank in per_rank] for name in [*SYNCS, "resume"]}


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


def test_between_meetings_a_replica_never_touches_the_dp_group(runs: Any) -> None:
    assert [rank["dp_exchanges"] for rank in runs["local-sgd H=3"]] == [0, 0, 0, 0]
    assert all(rank["dp_exchanges"] == 1 for rank in runs["diloco H=2"])  # one bucket, once
    assert all(rank["dp_exchanges"] >= 2 * STEPS for rank in runs["every-step"])


def test_replicas_differ_between_meetings(runs: Any) -> None:
    first, second = _replica(runs["local-sgd H=3"], 0), _replica(runs["local-sgd H=3"], 1)
    assert any(not torch.equal(first[n], second[n]) for n in first)


def test_a_diloco_resume_keeps_the_outer_momentum_and_equals_the_uninterrupted_run(
    runs: Any, checkpoints: Path
) -> None:
    """Inner plain SGD keeps no state, so the checkpoint (one copy of the weights, taken at a
    meeting, and the outer momentum) is all the run has: the resume is exact."""
    momenta = TensorReader(checkpoints / "step-00000002", OUTER_INDEX)
    assert momenta.names and all(momenta.get(n).abs().sum() > 0 for n in momenta.names)
    for rank in runs["resume"]:
        straight, again = rank["uninterrupted"], rank["resumed"]
        assert straight.keys() == again.keys()
        assert all(torch.equal(straight[n], again[n]) for n in straight)


def test_a_parameter_server_with_staleness_0_equals_every_step_sync(runs: Any) -> None:
    for dp in (0, 1):
        _close(_replica(runs["ps K=0"], dp), _replica(runs["every-step"], 0))


def test_staleness_0_computes_every_step_on_the_current_weights(runs: Any) -> None:
    assert all(rank["staleness"] == [0] * STEPS for rank in runs["ps K=0"])


def test_no_replica_runs_more_than_k_updates_ahead_of_the_server(runs: Any) -> None:
    assert all(len(rank["staleness"]) == STEPS for rank in runs["ps K=1"])
    assert all(0 <= lag <= 1 for rank in runs["ps K=1"] for lag in rank["staleness"])


def test_a_parameter_server_leaves_the_dp_group_idle_and_moves_a_stage_each_way(
    runs: Any,
) -> None:
    """Its pair groups carry the traffic: each replica other than the server's pushes its
    stage's fp32 gradients (after a 24-byte header) and pulls its weights (after an 8-byte
    answer) every step with K = 0; the server's rank keeps the fp32 masters (plain SGD keeps
    no state), the other replica nothing."""
    for rank in runs["ps K=0"]:
        numel = sum(t.numel() for t in rank["params"].values())
        assert rank["dp_exchanges"] == 0
        if rank["dp"] == 1:
            assert rank["bytes_per_step"] == 2 * 4 * numel + 24 + 8
        assert rank["server_bytes"] == (4 * numel if rank["dp"] == 0 else 0)
