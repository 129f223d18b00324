"""--fault-tolerant: a replica whose rank is SIGKILLed mid-run is relaunched alone while the
other replica trains on (the quorum shrinks to one); it rejoins with the live replica's
weights and optimizer state, fetched through torchft (not from disk), and the steps it
missed are counted. Each replica's ranks dump their final state here (the test's own
entry point wraps the engine's close) so the two replicas are compared tensor by tensor."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.comm.replica_group import REPLICA_ENV
from engine.comm.replica_launch import launch_replicas, lighthouse_for
from engine.runtime.engine import PipelineEngine
from engine.training.config import TrainConfig
from engine.training.loop import KILL_AT_STEP_ENV, KILL_RANK_ENV, TrainResult, train
from engine.training.workers import local_worker

os.environ.setdefault("RUST_LOG", "error")  # torchft's Lighthouse logs every quorum otherwise
pytest.importorskip("torchft")

STEPS, KILLED_STEP = 6, 2
SHAPE: dict[str, Any] = dict(model="gpt-tiny", steps=STEPS, global_batch=4, seq_len=16,
                             micro_batches=2, threads=1, timeout=60)  # fmt: skip


def _train_and_dump(config: TrainConfig, folder: str) -> TrainResult | object:
    """`local_worker`, with this rank's final weights and optimizer state saved to `folder`."""
    close = PipelineEngine.close

    def dumping_close(engine: PipelineEngine, **kwargs: Any) -> None:
        assert engine.optimizer is not None
        state = {"model": engine.module.state_dict(), "optimizer": engine.optimizer.state_dict()}
        name = f"replica{os.environ[REPLICA_ENV]}-rank{os.environ['RANK']}.pt"
        torch.save(state, Path(folder) / name)
        close(engine, **kwargs)

    PipelineEngine.close = dumping_close  # type: ignore[method-assign]
    return local_worker(config, False)


def _same(a: Any, b: Any) -> bool:
    """Nested state dicts equal, tensors bit for bit."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


@pytest.mark.slow
def test_a_killed_replica_rejoins_with_the_live_replicas_state(
    tokens: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(KILL_AT_STEP_ENV, str(KILLED_STEP))
    monkeypatch.setenv(KILL_RANK_ENV, "1")  # replica 1's only rank (pp 1)
    config = TrainConfig.of(**SHAPE, data=tokens, dp=2, fault_tolerant=True, max_restarts=1)
    with lighthouse_for(None, join_timeout_s=60) as address:
        run = launch_replicas(
            _train_and_dump,
            (config, str(tmp_path)),
            ranks=1,
            replicas=2,
            lighthouse=address,
            max_restarts=1,
        )
    assert run.relaunches == {1: 1} and not run.lost
    live, rejoined = run.results[0][0], run.results[1][0]
    assert live.missed_steps == 0 and len(live.losses) == STEPS
    # the steps the live replica committed alone; none when the relaunched one rejoined before
    # the live one could commit a step without it (its peer's death failed that step first)
    assert rejoined.missed_steps >= 0
    assert rejoined.first_step == KILLED_STEP + rejoined.missed_steps
    assert _same(
        torch.load(tmp_path / "replica0-rank0.pt"), torch.load(tmp_path / "replica1-rank0.pt")
    )
    monkeypatch.delenv(KILL_AT_STEP_ENV)
    reference = train(TrainConfig.of(**SHAPE, data=tokens), progress=False)
    # both replicas up: the quorum's average is the one-process step, to float tolerance
    both = slice(0, KILLED_STEP)
    assert live.losses[both] == pytest.approx(reference.losses[both], rel=1e-5)
    assert live.final_loss == pytest.approx(reference.final_loss, rel=0.05)
