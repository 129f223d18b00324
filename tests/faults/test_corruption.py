"""One flipped byte in any kind of file a checkpoint holds is caught on resume and the file
named (status 2), never trained on. The byte is drawn from a fixed seed, shown in the test id."""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest

from engine.training.config import TrainConfig
from engine.training.loop import train
from tests.faults.conftest import TINY
from tests.unit.cli_error import cli_error

SEED = 24
FILES = ["model-stage000.safetensors", "optim-stage000.safetensors",
         "model.safetensors.index.json", "optim.safetensors.index.json", "rng-rank00000.json",
         "trainer.json", "manifest.json"]  # fmt: skip
"""Every kind of file a one-process checkpoint holds."""


@pytest.fixture(scope="module")
def saved(tokens: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("saved")
    config = TrainConfig.of(model="gpt-tiny", steps=1, global_batch=4, seq_len=16,
                            micro_batches=2, threads=1, data=tokens, lr_schedule="constant",
                            checkpoint_dir=str(root))  # fmt: skip
    train(config, progress=False)
    return root


def _flip_one_byte(path: Path, rng: random.Random) -> int:
    data = bytearray(path.read_bytes())
    offset = rng.randrange(len(data))
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))
    return offset


def test_the_saved_checkpoint_holds_every_kind_of_file(saved: Path) -> None:
    assert sorted(p.name for p in (saved / "step-00000001").iterdir()) == sorted(FILES)


@pytest.mark.parametrize("name", FILES, ids=[f"{name}-seed{SEED}" for name in FILES])
def test_a_flipped_byte_is_caught_and_the_file_named(
    name: str, saved: Path, tokens: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "run"
    shutil.copytree(saved, root)
    offset = _flip_one_byte(root / "step-00000001" / name, random.Random(f"{SEED}-{name}"))
    argv = ["train", *TINY, "--data", tokens, "--steps", "2", "--checkpoint-dir", str(root),
            "--resume", "--lr-schedule", "constant"]  # fmt: skip
    status, err = cli_error(argv, capsys)
    assert status == 2, f"byte {offset} of {name}: {err}"
    assert name in err, f"byte {offset} of {name}: {err}"
    assert not (root / "step-00000002").exists()
