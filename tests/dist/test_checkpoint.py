"""Checkpoints on a mesh: resume bit for bit, reshard across layouts, fail together, and survive a
killed rank under the local launcher."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from engine.checkpoint import TrainerState, load_checkpoint, save_checkpoint
from engine.checkpoint.files import MODEL_INDEX, TensorReader
from engine.comm.mesh import init_mesh
from engine.runtime.engine import PipelineEngine
from engine.runtime.optim import build_optimizer
from engine.training.config import TrainConfig
from engine.training.data import prepare
from engine.training.loop import train
from models import layer_specs
from partitioners import partition_model
from tests.dist.harness import RanksFailed, run_ranks

RUN = {
    "steps": 6,
    "global_batch": 8,
    "micro_batches": 2,
    "seq_len": 32,
    "warmup_steps": 2,
    "threads": 1,
    "save_every": 3,
}


@pytest.fixture(scope="module")
def tokens(tmp_path_factory: pytest.TempPathFactory) -> str:
    folder = tmp_path_factory.mktemp("corpus")
    (folder / "text.txt").write_text(
        "a stage keeps its layers; a checkpoint keeps them all\n" * 300
    )
    return str(prepare(folder / "text.txt", folder / "tokens").bin_path)


def _train(rank: int, world_size: int, config: TrainConfig) -> tuple[float, ...]:
    return train(config, progress=False).losses


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for shard in sorted(directory.glob("*.safetensors")):
        out.update({f"{shard.name}:{k}": v for k, v in load_file(shard).items()})
    return out


@pytest.mark.parametrize("model", ["llama-tiny", "gpt-tiny"])
def test_pp2_resume_equals_the_uninterrupted_run_bit_for_bit(
    tmp_path: Path, tokens: str, model: str
) -> None:
    full = TrainConfig.of(**RUN, model=model, pp=2, data=tokens, checkpoint_dir=str(tmp_path / "a"))
    losses = run_ranks(_train, 2, full)[0]
    (tmp_path / "b").mkdir()
    shutil.copytree(tmp_path / "a" / "step-00000003", tmp_path / "b" / "step-00000003")
    (tmp_path / "b" / "latest").write_text("step-00000003\n")
    resumed = TrainConfig.of(
        **RUN, model=model, pp=2, data=tokens, resume=True, checkpoint_dir=str(tmp_path / "b")
    )
    assert run_ranks(_train, 2, resumed) == [losses[3:], losses[3:]]
    before = _tensors(tmp_path / "a" / "step-00000006")
    after = _tensors(tmp_path / "b" / "step-00000006")
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("zero", [2, 3])
def test_a_sharded_dp2_resume_equals_the_uninterrupted_run_bit_for_bit(
    tmp_path: Path, tokens: str, zero: int
) -> None:
    run = {**RUN, "model": "llama-tiny", "dp": 2, "zero": zero, "data": tokens}
    run["optimizer_impl"] = "per_tensor" if zero == 3 else "fused"
    losses = run_ranks(_train, 2, TrainConfig.of(**run, checkpoint_dir=str(tmp_path / "a")))[0]
    (tmp_path / "b").mkdir()
    shutil.copytree(tmp_path / "a" / "step-00000003", tmp_path / "b" / "step-00000003")
    (tmp_path / "b" / "latest").write_text("step-00000003\n")
    resumed = TrainConfig.of(**run, resume=True, checkpoint_dir=str(tmp_path / "b"))
    assert run_ranks(_train, 2, resumed) == [losses[3:], losses[3:]]
    before = _tensors(tmp_path / "a" / "step-00000006")
    after = _tensors(tmp_path / "b" / "step-00000006")
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)


def _engine(
    pp: int, dp: int, model: str, schedule: str = "1f1b", v: int = 1, *, seed: int
) -> PipelineEngine:
    specs = layer_specs(model)
    partition = partition_model(specs, method="uniform", num_stages=pp * v, seq_len=16)
    return PipelineEngine(
        specs,
        init_mesh(pp, dp, timeout_s=60),
        partition=partition,
        micro_batches=2 * pp,
        schedule=schedule,
        stages_per_rank=v,
        seed=seed,
        optimizer=lambda module: build_optimizer(module, lr=1e-2),
        timeout_s=60,
    )


def _params(engine: PipelineEngine) -> dict[str, torch.Tensor]:
    return {
        name: param.detach().clone()
        for stage in engine.stages.values()
        for name, param in stage.module.named_parameters()
    }


def _save_after_a_step(
    rank: int, world_size: int, root: str, pp: int, dp: int, model: str, schedule: str, v: int
) -> dict[str, torch.Tensor]:
    engine = _engine(pp, dp, model, schedule, v, seed=1)
    tokens = torch.randint(0, 256, (4 * pp, 17), generator=torch.Generator().manual_seed(0))
    rows = slice(engine.mesh.dp_rank * 2 * pp, (engine.mesh.dp_rank + 1) * 2 * pp)
    x, y = tokens[rows, :-1], tokens[rows, 1:]
    engine.train_step(x if engine.is_first else None, y if engine.is_last else None)
    save_checkpoint(engine, layer_specs(model), root, state=TrainerState(step=1))
    return _params(engine)


def _load(rank: int, world_size: int, root: str, pp: int, model: str) -> dict[str, torch.Tensor]:
    engine = _engine(pp, 1, model, seed=2)
    load_checkpoint(engine, layer_specs(model), root)
    return _params(engine)


def _merged(per_rank: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {name: t for params in per_rank for name, t in params.items()}


def test_a_pp2_dp2_checkpoint_loads_into_three_stages(tmp_path: Path) -> None:
    saved = _merged(run_ranks(_save_after_a_step, 4, str(tmp_path), 2, 2, "llama-tiny", "1f1b", 1))
    loaded = _merged(run_ranks(_load, 3, str(tmp_path), 3, "llama-tiny"))
    assert saved.keys() == loaded.keys()
    assert all(torch.equal(saved[n], loaded[n]) for n in saved)


def test_ranks_holding_two_stages_save_what_one_process_loads(tmp_path: Path) -> None:
    saved = _merged(
        run_ranks(_save_after_a_step, 2, str(tmp_path), 2, 1, "gpt-tiny", "interleaved_1f1b", 2)
    )
    reader = TensorReader(tmp_path / "step-00000001", MODEL_INDEX)
    # Stage 3 holds only the head, a tied copy stored with the embedding: it writes no shard.
    assert set(reader.weight_map.values()) == {f"model-stage00{s}.safetensors" for s in range(3)}
    loaded = _load(0, 1, str(tmp_path), 1, "gpt-tiny")  # one stack: the head shares wte
    assert loaded.keys() == saved.keys() - {"layers.6.weight"}
    assert all(torch.equal(saved[n], loaded[n]) for n in loaded)


def test_a_v_placed_checkpoint_loads_into_one_stage_per_rank(tmp_path: Path) -> None:
    """Rank 0 of the V holds stages 0 and 3 (embedding and tied head, one parameter); the
    loading run holds them on ranks 0 and 1: names are global, so the placement is free."""
    saved = _merged(run_ranks(_save_after_a_step, 2, str(tmp_path), 2, 1, "gpt-tiny", "zb_v", 2))
    loaded = _merged(run_ranks(_load, 2, str(tmp_path), 2, "gpt-tiny"))
    assert saved.keys() == loaded.keys()
    assert all(torch.equal(saved[n], loaded[n]) for n in saved)


def test_a_corrupt_shard_fails_every_rank_with_its_name(tmp_path: Path) -> None:
    run_ranks(_save_after_a_step, 2, str(tmp_path), 2, 1, "llama-tiny", "1f1b", 1)
    shard = tmp_path / "step-00000001" / "model-stage001.safetensors"
    shard.write_bytes(shard.read_bytes()[:-8])
    with pytest.raises(RanksFailed) as failed:
        run_ranks(_load, 2, str(tmp_path), 2, "llama-tiny", timeout_s=60)
    report = str(failed.value)
    assert "--- rank 0 ---" in report and "--- rank 1 ---" in report
    assert report.count("rank 1: ") >= 2 and "model-stage001.safetensors: sha256" in report


def test_an_edited_rng_file_of_rank_1_fails_every_rank_with_its_name(tmp_path: Path) -> None:
    run_ranks(_save_after_a_step, 2, str(tmp_path), 2, 1, "llama-tiny", "1f1b", 1)
    rng = tmp_path / "step-00000001" / "rng-rank00001.json"
    rng.write_text(rng.read_text().replace('"torch_cpu": "', '"torch_cpu": "00', 1))
    with pytest.raises(RanksFailed) as failed:
        run_ranks(_load, 2, str(tmp_path), 2, "llama-tiny", timeout_s=60)
    report = str(failed.value)
    assert "--- rank 0 ---" in report and "--- rank 1 ---" in report
    assert "rank 1: " in report and "rng-rank00001.json: sha256" in report


def _uninterrupted(data: str, root: Path) -> tuple[float, ...]:
    """The reference in one process: llama's pp=2 steps equal pp=1 steps bit for bit."""
    config = TrainConfig.of(
        model="llama-tiny",
        steps=8,
        global_batch=8,
        micro_batches=2,
        seq_len=32,
        threads=1,
        data=data,
        checkpoint_dir=str(root),
    )
    return train(config, progress=False).losses


def _load_where_rank1_sees_no_latest(
    rank: int, world_size: int, root: str
) -> dict[str, torch.Tensor]:
    """Rank 1's view of the folder lacks `latest` (no shared filesystem, a save racing the
    load): rank 0's choice of checkpoint must be the one every rank loads."""
    if rank == 1:
        import engine.checkpoint.load

        def blind(*_: object, **__: object) -> list[Path]:
            raise AssertionError("rank 1 read the checkpoint folder itself")

        engine.checkpoint.load.checkpoint_candidates = blind  # type: ignore[assignment]
    return _load(rank, world_size, root, 2, "llama-tiny")


def test_rank_0_chooses_the_checkpoint_every_rank_loads(tmp_path: Path) -> None:
    saved = _merged(run_ranks(_save_after_a_step, 2, str(tmp_path), 2, 1, "llama-tiny", "1f1b", 1))
    loaded = _merged(run_ranks(_load_where_rank1_sees_no_latest, 2, str(tmp_path)))
    assert all(torch.equal(saved[n], loaded[n]) for n in saved)
