"""Semi-synchronous data parallelism (local SGD, DiLoCo) on pp 2 × dp 2: what the algorithms
promise, against every-step sync on the same four ranks, all runs in one launch.

Plain SGD (no momentum, no weight decay) makes one local step and an average of the weights
the same update as a step on the averaged gradients, up to the order of float sums.
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from engine.checkpoint.files import TensorReader
from engine.checkpoint.outer_state import OUTER_INDEX
from engine.comm.mesh import init_mesh
from engine.config import OptimizerSpec, ReplicaSync
from engine.runtime.engine import PipelineEngine
from engine.training.config import TrainConfig
from engine.training.data import prepare
from engine.training.loop import train
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
    with _counting_exchanges(mesh.dp_group) as dp_exchanges:
        for step in range(STEPS):
            inputs, targets = _batch(step)
            engine.train_step(inputs[rows], targets[rows])
    params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    engine.close()
    return {"dp": mesh.dp_rank, "params": params, "dp_exchanges": dp_exchanges[0]}


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


def test_between_meetings_a_replica_never_touches_the_dp_group(runs: Any) -> None:
    assert [rank["dp_exchanges"] for rank in runs["local-sgd H=3"]] == [0, 0, 0, 0]
    assert all(rank["dp_exchanges"] == 1 for rank in runs["diloco H=2"])  # one bucket, once
    assert all(rank["dp_exchanges"] >= 2 * STEPS for rank in runs["every-step"])


def test_replicas_differ_between_meetings(runs: Any) -> None:
    first, second = _replica(runs["local-sgd H=3"], 0), _replica(runs["local-sgd H=3"], 1)
    assert any(not torch.equal(first[n], second[n]) for n in first)


@pytest.fixture(scope="module")
def tokens(tmp_path_factory: pytest.TempPathFactory) -> str:
    folder = tmp_path_factory.mktemp("corpus")
    (folder / "text.txt").write_text("replicas meet every other step and keep going\n" * 200)
    return str(prepare(folder / "text.txt", folder / "tokens").bin_path)


def _losses(rank: int, world_size: int, config: TrainConfig) -> tuple[float, ...]:
    return train(config, progress=False).losses


def test_a_diloco_resume_keeps_the_outer_momentum_and_equals_the_uninterrupted_run(
    tmp_path: Path, tokens: str
) -> None:
    """Inner plain SGD keeps no state, so the checkpoint (one copy of the weights, taken at a
    meeting, and the outer momentum) is all the run has: the resume is exact."""
    run = {
        **{"model": "gpt-tiny", "dp": 2, "steps": 4, "save_every": 2, "global_batch": 4},
        **{"seq_len": 16, "micro_batches": 1, "threads": 1, "data": tokens},
        **{"optimizer": "sgd", "momentum": 0.0, "dp_sync": "diloco", "sync_every": 2},
    }
    losses = run_ranks(_losses, 2, TrainConfig.of(**run, checkpoint_dir=str(tmp_path / "a")))
    saved = tmp_path / "a" / "step-00000002"
    momenta = TensorReader(saved, OUTER_INDEX)
    assert momenta.names and all(momenta.get(n).abs().sum() > 0 for n in momenta.names)
    (tmp_path / "b").mkdir()
    shutil.copytree(saved, tmp_path / "b" / saved.name)
    (tmp_path / "b" / "latest").write_text(f"{saved.name}\n")
    resumed = TrainConfig.of(**run, resume=True, checkpoint_dir=str(tmp_path / "b"))
    assert run_ranks(_losses, 2, resumed) == [rank[2:] for rank in losses]
    for shard in ("model-stage000.safetensors", "outer-stage000.safetensors"):
        before = load_file(tmp_path / "a" / "step-00000004" / shard)
        after = load_file(tmp_path / "b" / "step-00000004" / shard)
        assert before.keys() == after.keys()
        assert all(torch.equal(before[k], after[k]) for k in before)
