"""A rank killed with SIGKILL at a step drawn from a fixed seed (shown in the test id) is
restarted by --max-restarts, and the run resumes to the uninterrupted run's weights bit for
bit."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from engine.cli.main import main
from engine.training.config import TrainConfig
from engine.training.loop import KILL_AT_STEP_ENV, KILL_RANK_ENV, train

SEED = 24
STEPS = 4
_draw = random.Random(SEED)
KILLED_RANK, KILLED_STEP = _draw.randrange(2), _draw.randrange(1, STEPS)
SHAPE = dict(model="llama-tiny", steps=STEPS, global_batch=4, seq_len=16, micro_batches=2,
             threads=1)  # fmt: skip
"""llama-tiny: no weight tied across stages, so pp = 2 equals one process bit for bit."""


def _weights(step_dir: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(step_dir.glob("model-stage*.safetensors")):
        tensors.update(load_file(shard))
    return tensors


@pytest.mark.slow
@pytest.mark.parametrize("rank,step", [(KILLED_RANK, KILLED_STEP)],
                         ids=[f"seed{SEED}-rank{KILLED_RANK}-step{KILLED_STEP}"])  # fmt: skip
def test_a_killed_rank_resumes_to_the_uninterrupted_weights(
    rank: int,
    step: int,
    tokens: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv(KILL_AT_STEP_ENV, str(step))
    monkeypatch.setenv(KILL_RANK_ENV, str(rank))
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in SHAPE.items()]
    argv = ["train", *flags, "--data", tokens, "--pp", "2", "--no-progress", "--save-every",
            "1", "--checkpoint-dir", str(tmp_path / "killed"), "--resume", "--max-restarts",
            "1"]  # fmt: skip
    assert main(argv) == 0
    assert f"resumed from step {step}" in capfd.readouterr().err
    monkeypatch.delenv(KILL_AT_STEP_ENV)
    reference = TrainConfig.of(**SHAPE, data=tokens, checkpoint_dir=str(tmp_path / "reference"))
    train(reference, progress=False)
    name = f"step-{STEPS:08d}"
    killed, uninterrupted = (
        _weights(tmp_path / "killed" / name),
        _weights(tmp_path / "reference" / name),
    )
    assert killed.keys() == uninterrupted.keys()
    assert all(torch.equal(killed[k], uninterrupted[k]) for k in uninterrupted)
