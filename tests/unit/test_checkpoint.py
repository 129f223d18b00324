"""Checkpoints in one process: the files, any layout loading any other, and bad input.

A "holder" is what a rank holds: some stages of a partition and one optimizer over them. One
process holding all stages of a partition writes exactly the files a pipeline of them would.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import stat
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from engine.checkpoint import (
    TrainerState,
    checkpoint_candidates,
    load_checkpoint,
    save_checkpoint,
)
from engine.checkpoint.files import MODEL_INDEX, OPTIM_INDEX, CheckpointError, TensorReader
from engine.checkpoint.manifest import MANIFEST, unverified_note, write_manifest
from engine.checkpoint.rng_state import capture_rng, restore_rng
from engine.checkpoint.weights import read_module_weights, read_optimizer_state
from engine.comm.mesh import Mesh
from engine.runtime.optim import build_optimizer
from engine.runtime.stage import PipelineStage
from models import GPTConfig, build_layers, layer_specs
from partitioners import Partition

torch.set_num_threads(1)


def _holder(model: Any, boundaries: tuple[int, ...], *, seed: int = 0) -> Any:
    specs = layer_specs(model)
    partition = Partition(boundaries=boundaries)
    stages = {
        s: PipelineStage(
            specs,
            stage=s,
            layers=partition.layers_of(s),
            num_stages=partition.num_stages,
            seed=seed,
        )
        for s in range(partition.num_stages)
    }
    module = nn.ModuleList(stage.module for stage in stages.values())
    mesh = Mesh(pp=1, dp=1, rank=0, pp_rank=0, dp_rank=0, device=torch.device("cpu"))
    optimizer = build_optimizer(module, lr=1e-2, weight_decay=0.1)
    return SimpleNamespace(
        stages=stages,
        module=module,
        mesh=mesh,
        optimizer=optimizer,
        schedule=SimpleNamespace(name="test"),
        specs=specs,
    )


def _step(holder: Any) -> None:
    """A deterministic optimizer step, so the optimizer has state to save."""
    for param in holder.module.parameters():
        param.grad = torch.full_like(param, 0.01) + param.detach() * 0.1
    holder.optimizer.step()


def _params(holder: Any) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for stage in holder.stages.values():
        out.update({n: p.detach().clone() for n, p in stage.module.named_parameters()})
    return out


def _save(holder: Any, root: Path, step: int = 1, keep: int = 0) -> Path:
    state = TrainerState(step=step, loader={"position": step}, scheduler={"last_epoch": step})
    return save_checkpoint(holder, holder.specs, root, state=state, keep=keep)


def _trained_checkpoint(tmp_path: Path, model: str = "llama-tiny") -> tuple[Any, Path]:
    holder = _holder(model, (0, 3, len(layer_specs(model))))
    _step(holder)
    return holder, _save(holder, tmp_path / "ck")


def test_a_checkpoint_is_a_step_directory_named_by_latest(tmp_path: Path) -> None:
    _, directory = _trained_checkpoint(tmp_path)
    assert directory.name == "step-00000001"
    assert (tmp_path / "ck" / "latest").read_text() == "step-00000001\n"
    assert sorted(p.name for p in directory.iterdir()) == [
        MANIFEST,
        "model-stage000.safetensors",
        "model-stage001.safetensors",
        MODEL_INDEX,
        "optim-stage000.safetensors",
        "optim-stage001.safetensors",
        OPTIM_INDEX,
        "rng-rank00000.json",
        "trainer.json",
    ]
    assert [p.name for p in (tmp_path / "ck").iterdir() if p.name.startswith(".")] == []


def test_the_index_is_shaped_like_hf_with_a_sha256_per_shard(tmp_path: Path) -> None:
    _, directory = _trained_checkpoint(tmp_path)
    index = json.loads((directory / MODEL_INDEX).read_text())
    assert index["weight_map"]["layers.0.embed_tokens.weight"] == "model-stage000.safetensors"
    assert index["weight_map"]["layers.6.lm_head.weight"] == "model-stage001.safetensors"
    for file, digest in index["metadata"]["sha256"].items():
        assert hashlib.sha256((directory / file).read_bytes()).hexdigest() == digest
    assert index["metadata"]["partition"] == [0, 3, 7]


def test_a_tied_weight_is_stored_once_under_the_embedding_name(tmp_path: Path) -> None:
    _, directory = _trained_checkpoint(tmp_path, "gpt-tiny")
    weight_map = json.loads((directory / MODEL_INDEX).read_text())["weight_map"]
    assert weight_map["layers.0.wte.weight"] == "model-stage000.safetensors"
    assert "layers.6.weight" not in weight_map
    optim = json.loads((directory / OPTIM_INDEX).read_text())["weight_map"]
    assert "layers.0.wte.weight.exp_avg" in optim and "layers.6.weight.exp_avg" not in optim


@pytest.mark.parametrize("model", ["llama-tiny", "gpt-tiny"])
@pytest.mark.parametrize("boundaries", [(0, 7), (0, 2, 5, 7), (0, 1, 2, 3, 4, 5, 6, 7)])
def test_any_layout_loads_the_weights_of_any_other(
    tmp_path: Path, model: str, boundaries: tuple[int, ...]
) -> None:
    saved, directory = _trained_checkpoint(tmp_path, model)
    want = _params(saved)
    loaded = _holder(model, boundaries, seed=99)
    load_checkpoint(loaded, loaded.specs, directory)
    got = _params(loaded)
    embedding = "layers.0.wte.weight" if model == "gpt-tiny" else "layers.0.embed_tokens.weight"
    for name, tensor in got.items():
        source = embedding if model == "gpt-tiny" and name == "layers.6.weight" else name
        assert torch.equal(tensor, want[source]), name


@pytest.mark.parametrize("boundaries", [(0, 7), (0, 2, 5, 7)])
def test_optimizer_state_follows_its_parameter_into_another_layout(
    tmp_path: Path, boundaries: tuple[int, ...]
) -> None:
    saved, directory = _trained_checkpoint(tmp_path)
    by_name = {
        n: saved.optimizer.state[p]
        for stage in saved.stages.values()
        for n, p in stage.module.named_parameters()
    }
    loaded = _holder("llama-tiny", boundaries, seed=99)
    load_checkpoint(loaded, loaded.specs, directory)
    for stage in loaded.stages.values():
        for name, param in stage.module.named_parameters():
            state = loaded.optimizer.state[param]
            assert set(state) == {"step", "exp_avg", "exp_avg_sq"}
            for key, value in state.items():
                assert torch.equal(value, by_name[name][key]), (name, key)
    assert loaded.optimizer.param_groups[0]["lr"] == saved.optimizer.param_groups[0]["lr"]


def test_scalar_optimizer_state_comes_back_as_the_same_python_scalar(tmp_path: Path) -> None:
    holder = _holder("llama-tiny", (0, 7))
    _step(holder)
    for param_state in holder.optimizer.state.values():  # as DeepSpeed's CPU Adam keeps it
        param_state["step"] = int(param_state["step"])
    directory = _save(holder, tmp_path / "ck")
    source = TensorReader(directory, OPTIM_INDEX)
    modules = [stage.module for stage in holder.stages.values()]
    state = read_optimizer_state(holder.optimizer, modules, holder.specs, source)["state"]
    steps = [param_state["step"] for param_state in state.values()]
    assert steps and all(type(step) is int and step == 1 for step in steps)


def test_a_stage_opens_only_the_shards_holding_its_layers(tmp_path: Path) -> None:
    _, directory = _trained_checkpoint(tmp_path)
    specs = layer_specs("llama-tiny")
    reader = TensorReader(directory, MODEL_INDEX)
    read_module_weights(build_layers(specs, range(4, 7), seed=0), specs, reader, exact_dtype=True)
    assert reader.opened == {"model-stage001.safetensors"}


def test_a_head_only_stage_reads_the_tied_weight_from_the_embedding_shard(tmp_path: Path) -> None:
    saved, directory = _trained_checkpoint(tmp_path, "gpt-tiny")
    specs = layer_specs("gpt-tiny")
    head = build_layers(specs, [6], seed=5)
    reader = TensorReader(directory, MODEL_INDEX)
    [(_, tensor)] = read_module_weights(head, specs, reader, exact_dtype=True)
    assert reader.opened == {"model-stage000.safetensors"}
    assert torch.equal(tensor, _params(saved)["layers.0.wte.weight"])


def test_keep_deletes_the_oldest_checkpoints_once_latest_moved(tmp_path: Path) -> None:
    holder = _holder("llama-tiny", (0, 7))
    for step in (2, 4, 6, 8):
        _save(holder, tmp_path, step=step, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "latest",
        "step-00000006",
        "step-00000008",
    ]


def test_saving_a_step_again_replaces_it(tmp_path: Path) -> None:
    holder = _holder("llama-tiny", (0, 7))
    _save(holder, tmp_path, step=2)
    _step(holder)
    directory = _save(holder, tmp_path, step=2)
    loaded = _holder("llama-tiny", (0, 7), seed=3)
    load_checkpoint(loaded, loaded.specs, directory)
    want = _params(holder)
    assert all(torch.equal(t, want[n]) for n, t in _params(loaded).items())


def test_an_interrupted_save_is_ignored_and_cleaned_up(tmp_path: Path) -> None:
    holder = _holder("llama-tiny", (0, 7))
    _save(holder, tmp_path, step=2)
    (tmp_path / ".tmp-step-00000004").mkdir()
    assert checkpoint_candidates(tmp_path) == [tmp_path / "step-00000002"]
    _save(holder, tmp_path, step=6)
    assert not (tmp_path / ".tmp-step-00000004").exists()


def test_trainer_state_comes_back_with_the_checkpoint(tmp_path: Path) -> None:
    holder = _holder("llama-tiny", (0, 7))
    _save(holder, tmp_path, step=3)
    _, state = load_checkpoint(holder, holder.specs, tmp_path)
    assert (state.step, state.loader, state.scheduler) == (3, {"position": 3}, {"last_epoch": 3})


def test_rng_states_round_trip() -> None:
    state = json.loads(json.dumps(capture_rng()))
    expected = torch.rand(3)
    restore_rng(state)
    assert torch.equal(torch.rand(3), expected)


# Bad input: every failure names the file (and the tensor), and nothing is half loaded.


def _rewrite_index(directory: Path, edit: Any) -> None:
    """An index that is wrong yet sealed by the manifest, as a buggy writer would leave it."""
    path = directory / MODEL_INDEX
    index = json.loads(path.read_text())
    edit(index)
    path.write_text(json.dumps(index))
    write_manifest(directory)


def test_a_corrupt_shard_is_named_by_its_checksum(tmp_path: Path) -> None:
    holder, directory = _trained_checkpoint(tmp_path)
    shard = directory / "model-stage001.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"model-stage001\.safetensors: sha256 .* not match"):
        load_checkpoint(holder, holder.specs, directory)


def test_a_tensor_missing_from_the_index_is_named(tmp_path: Path) -> None:
    holder, directory = _trained_checkpoint(tmp_path)
    _rewrite_index(directory, lambda index: index["weight_map"].pop("layers.2.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"lacks 1 .*layers\.2\.mlp\.up_proj\.weight"):
        load_checkpoint(holder, holder.specs, directory)


def test_an_index_pointing_at_a_missing_file_is_named(tmp_path: Path) -> None:
    holder, directory = _trained_checkpoint(tmp_path)
    (directory / "model-stage000.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"points at model-stage000\.safetensors.*not exist"):
        load_checkpoint(holder, holder.specs, directory)


def test_a_tensor_of_the_wrong_shape_is_named_with_its_file(tmp_path: Path) -> None:
    holder, directory = _trained_checkpoint(tmp_path)
    shard = directory / "model-stage001.safetensors"
    tensors = load_file(shard)
    tensors["layers.6.lm_head.weight"] = torch.zeros(512, 64)
    save_file(tensors, shard)
    digest = hashlib.sha256(shard.read_bytes()).hexdigest()
    _rewrite_index(directory, lambda i: i["metadata"]["sha256"].update({shard.name: digest}))
    with pytest.raises(
        CheckpointError, match=r"model-stage001\.safetensors: tensor 'layers\.6\.lm_head\.weight'"
    ):
        load_checkpoint(holder, holder.specs, directory)


def test_a_checkpoint_of_another_model_is_refused(tmp_path: Path) -> None:
    _, directory = _trained_checkpoint(tmp_path, "gpt-tiny")
    wider_config = GPTConfig(vocab_size=512, n_layer=4, n_head=4, d_model=64, max_seq_len=128)
    wider = _holder(wider_config, (0, 7))
    with pytest.raises(CheckpointError, match=r"another model.*vocab_size.*256, 512"):
        load_checkpoint(wider, wider.specs, directory)


def test_a_failed_load_changes_nothing(tmp_path: Path) -> None:
    _, directory = _trained_checkpoint(tmp_path)
    (directory / "model-stage001.safetensors").write_bytes(b"broken")
    fresh = _holder("llama-tiny", (0, 7), seed=42)
    before = _params(fresh)
    with pytest.raises(CheckpointError):
        load_checkpoint(fresh, fresh.specs, directory)
    assert all(torch.equal(before[n], t) for n, t in _params(fresh).items())
    assert not fresh.optimizer.state


def _two_checkpoints_latest_corrupt(tmp_path: Path) -> Any:
    holder = _holder("llama-tiny", (0, 3, 7))
    _save(holder, tmp_path, step=2)
    _step(holder)
    _save(holder, tmp_path, step=4)
    (tmp_path / "step-00000004" / "optim-stage000.safetensors").write_bytes(b"broken")
    return holder


def test_a_corrupt_latest_fails_without_fallback(tmp_path: Path) -> None:
    holder = _two_checkpoints_latest_corrupt(tmp_path)
    with pytest.raises(CheckpointError, match=r"step-00000004.*optim-stage000\.safetensors"):
        load_checkpoint(holder, holder.specs, tmp_path)


def test_a_corrupt_latest_names_the_previous_checkpoint_and_the_fallback_flag(
    tmp_path: Path,
) -> None:
    holder = _two_checkpoints_latest_corrupt(tmp_path)
    with pytest.raises(
        CheckpointError,
        match=r"previous complete checkpoint is .*step-00000002: pass --resume-fallback",
    ):
        load_checkpoint(holder, holder.specs, tmp_path)


def test_fallback_loads_the_previous_complete_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    holder = _two_checkpoints_latest_corrupt(tmp_path)
    directory, state = load_checkpoint(holder, holder.specs, tmp_path, fallback=True)
    assert (directory.name, state.step) == ("step-00000002", 2)
    assert "optim-stage000.safetensors" in capsys.readouterr().err


def test_checkpoints_without_a_latest_pointer_need_fallback(tmp_path: Path) -> None:
    holder = _holder("llama-tiny", (0, 7))
    _save(holder, tmp_path, step=2)
    (tmp_path / "latest").unlink()
    newest = tmp_path / "step-00000002"
    with pytest.raises(
        CheckpointError,
        match=f"no 'latest' pointer.*newest complete one is {re.escape(str(newest))}: "
        "pass --resume-fallback",
    ):
        checkpoint_candidates(tmp_path)
    assert checkpoint_candidates(tmp_path, fallback=True) == [newest]


def test_a_latest_naming_no_checkpoint_names_the_newest_complete_one(tmp_path: Path) -> None:
    holder = _holder("llama-tiny", (0, 7))
    _save(holder, tmp_path, step=2)
    (tmp_path / "latest").write_text("step-00000009\n")
    newest = re.escape(str(tmp_path / "step-00000002"))
    with pytest.raises(
        CheckpointError, match=f"names 'step-00000009'.*newest complete one is {newest}"
    ):
        checkpoint_candidates(tmp_path)


@pytest.mark.parametrize("umask", [0o022, 0o027], ids=["umask022", "umask027"])
def test_checkpoint_files_get_the_mode_open_gives(tmp_path: Path, umask: int) -> None:
    """Shards, indexes, trainer.json, rng states and `latest`: readable as the umask allows,
    not the owner-only 0600 of a temp file."""
    old = os.umask(umask)
    try:
        _, directory = _trained_checkpoint(tmp_path)
    finally:
        os.umask(old)
    files = [*directory.iterdir(), tmp_path / "ck" / "latest"]
    assert {p.name: stat.S_IMODE(p.stat().st_mode) for p in files} == {
        p.name: 0o666 & ~umask for p in files
    }
    assert stat.S_IMODE(directory.stat().st_mode) == 0o777 & ~umask


def test_a_folder_without_checkpoints_is_named(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=f"{tmp_path} holds no checkpoint"):
        checkpoint_candidates(tmp_path)


def test_a_checkpoint_path_that_does_not_exist_is_named_as_missing(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=f"{tmp_path / 'nothere'} does not exist"):
        checkpoint_candidates(tmp_path / "nothere")


def test_a_weights_only_checkpoint_cannot_resume_an_optimizer(tmp_path: Path) -> None:
    holder, directory = _trained_checkpoint(tmp_path)
    shutil.rmtree(directory / "optim-stage000.safetensors", ignore_errors=True)
    (directory / OPTIM_INDEX).unlink()
    with pytest.raises(CheckpointError, match=r"optim\.safetensors\.index\.json does not exist"):
        load_checkpoint(holder, holder.specs, directory)
    load_checkpoint(holder, holder.specs, directory, weights_only=True)


def _cut_off_between_the_renames(root: Path, step: int) -> Path:
    """What a crash leaves when it strikes a re-save of `step` between its two renames."""
    final = root / f"step-{step:08d}"
    trash = root / f".trash-{final.name}-0123abcd"
    final.rename(trash)
    return trash


def test_a_resave_cut_off_between_its_renames_names_the_previous_copy(tmp_path: Path) -> None:
    holder = _holder("llama-tiny", (0, 7))
    _save(holder, tmp_path, step=2)
    trash = _cut_off_between_the_renames(tmp_path, 2)
    with pytest.raises(CheckpointError, match=rf"previous copy is {re.escape(str(trash))}"):
        checkpoint_candidates(tmp_path)


def test_the_next_save_puts_a_cut_off_resaves_previous_copy_back(tmp_path: Path) -> None:
    holder = _holder("llama-tiny", (0, 7))
    _save(holder, tmp_path, step=2)
    _cut_off_between_the_renames(tmp_path, 2)
    _save(holder, tmp_path, step=3)
    assert (tmp_path / "step-00000002" / "trainer.json").is_file()
    assert not list(tmp_path.glob(".trash-*"))


# The manifest: every metadata file a resume reads is checksummed like a shard.


def _edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new, 1))


_METADATA_EDITS = {
    "trainer.json": ('"last_epoch": 4', '"last_epoch": 5'),
    OPTIM_INDEX: ('"lr": 0.01', '"lr": 0.02'),
    "rng-rank00000.json": ('"torch_cpu": "', '"torch_cpu": "00'),
}


def _two_checkpoints_latest_edited(tmp_path: Path, file: str) -> Any:
    holder = _holder("llama-tiny", (0, 3, 7))
    _save(holder, tmp_path, step=2)
    _step(holder)
    _save(holder, tmp_path, step=4)
    _edit(tmp_path / "step-00000004" / file, *_METADATA_EDITS[file])
    return holder


@pytest.mark.parametrize("file", sorted(_METADATA_EDITS))
def test_an_edited_metadata_file_fails_the_load_naming_it(tmp_path: Path, file: str) -> None:
    holder = _two_checkpoints_latest_edited(tmp_path, file)
    pattern = rf"step-00000004/{re.escape(file)}: sha256 .* does not match .*/manifest\.json"
    with pytest.raises(CheckpointError, match=pattern):
        load_checkpoint(holder, holder.specs, tmp_path)


def test_an_edited_metadata_file_names_the_previous_checkpoint_and_the_fallback_flag(
    tmp_path: Path,
) -> None:
    holder = _two_checkpoints_latest_edited(tmp_path, "trainer.json")
    with pytest.raises(
        CheckpointError,
        match=r"previous complete checkpoint is .*step-00000002: pass --resume-fallback",
    ):
        load_checkpoint(holder, holder.specs, tmp_path)


@pytest.mark.parametrize("file", sorted(_METADATA_EDITS))
def test_fallback_skips_a_checkpoint_with_an_edited_metadata_file(
    tmp_path: Path, file: str, capsys: pytest.CaptureFixture[str]
) -> None:
    holder = _two_checkpoints_latest_edited(tmp_path, file)
    directory, state = load_checkpoint(holder, holder.specs, tmp_path, fallback=True)
    assert (directory.name, state.step, state.scheduler) == ("step-00000002", 2, {"last_epoch": 2})
    assert f"{file}: sha256" in capsys.readouterr().err


def test_a_damaged_manifest_is_named_as_such(tmp_path: Path) -> None:
    holder, directory = _trained_checkpoint(tmp_path)
    _edit(directory / MANIFEST, '"trainer.json": "', '"trainer.json": "0')
    with pytest.raises(CheckpointError, match=r"manifest\.json is unreadable or fails its own"):
        load_checkpoint(holder, holder.specs, directory)


def test_a_checkpoint_without_a_manifest_loads_with_a_note(tmp_path: Path) -> None:
    saved, directory = _trained_checkpoint(tmp_path)
    (directory / MANIFEST).unlink()
    loaded = _holder("llama-tiny", (0, 7), seed=99)
    load_checkpoint(loaded, loaded.specs, directory)
    assert all(torch.equal(t, _params(saved)[n]) for n, t in _params(loaded).items())
    assert "no manifest.json (saved by an earlier meshpipe)" in str(unverified_note(directory))


def test_a_checkpoint_with_its_manifest_has_no_note(tmp_path: Path) -> None:
    _, directory = _trained_checkpoint(tmp_path)
    assert unverified_note(directory) is None
