"""Every rank must see the checkpoint folder: ranks on "hosts" with folders of their own fail
together before the first step, naming the blind ranks and the fix; a shared folder trains."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from engine.checkpoint.owner import OWNER_FILE
from engine.training.config import TrainConfig
from engine.training.data import prepare
from engine.training.loop import train
from engine.training.shared_folder import TOKEN_PREFIX
from tests.dist.harness import RanksFailed, run_ranks

RUN = {"model": "gpt-tiny", "steps": 1, "global_batch": 4, "micro_batches": 2, "seq_len": 16,
       "threads": 1, "pp": 2}  # fmt: skip


@pytest.fixture(scope="module")
def tokens(tmp_path_factory: pytest.TempPathFactory) -> str:
    folder = tmp_path_factory.mktemp("corpus")
    (folder / "text.txt").write_text("every rank writes its part of a checkpoint\n" * 200)
    return str(prepare(folder / "text.txt", folder / "tokens").bin_path)


def _train_on_own_host(rank: int, world_size: int, root: Path, data: str) -> None:
    """Each rank works in its own "host" folder, so the relative --checkpoint-dir differs."""
    host = root / f"host{rank}"
    host.mkdir()
    os.chdir(host)
    config = TrainConfig.of(**RUN, data=data, checkpoint_dir="ckpt", metrics_file="m.jsonl")
    train(config, progress=False)


def test_ranks_with_folders_of_their_own_fail_together_before_the_first_step(
    tmp_path: Path, tokens: str
) -> None:
    with pytest.raises(RanksFailed) as failed:
        run_ranks(_train_on_own_host, 2, tmp_path, tokens)
    message = str(failed.value)
    assert message.count("--checkpoint-dir ckpt is not one folder for every rank") == 2
    assert "rank 1 (host " in message and f"{tmp_path / 'host1' / 'ckpt'}) cannot see" in message
    assert f"wrote into {tmp_path / 'host0' / 'ckpt'}" in message
    assert "on a filesystem every host mounts" in message
    assert not (tmp_path / "host0" / "m.jsonl").exists()  # no step ran
    assert list((tmp_path / "host0" / "ckpt").iterdir()) == []  # the token is removed


def _train_shared(rank: int, world_size: int, folder: str, data: str) -> tuple[float, ...]:
    config = TrainConfig.of(**RUN, data=data, checkpoint_dir=folder)
    return train(config, progress=False).losses


def test_a_shared_folder_passes_and_keeps_no_token(tmp_path: Path, tokens: str) -> None:
    folder = tmp_path / "shared"
    run_ranks(_train_shared, 2, str(folder), tokens)
    expected = sorted([OWNER_FILE, "latest", "step-00000001"])  # the run's lock stays, emptied
    assert sorted(p.name for p in folder.iterdir()) == expected
    assert not list(folder.glob(f"{TOKEN_PREFIX}*"))
