"""A broken or mistaken Hugging Face folder ends in one line naming the file and the fix."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.checkpoint.files import CheckpointError
from engine.checkpoint.hf_interop import HFSource, export_hf, import_hf
from engine.checkpoint.save import save_weights
from engine.checkpoint.weights import stored_parameters
from models import build_layers, layer_specs
from tests.unit.cli_error import cli_error

torch.set_num_threads(1)

CORRUPT = "is corrupt or truncated (Error while deserializing header"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """gpt-tiny at its initial weights: enough for every error here, and no training."""
    specs = layer_specs("gpt-tiny")
    out = tmp_path_factory.mktemp("ck") / "step-00000000"
    return save_weights(out, specs, stored_parameters(build_layers(specs, seed=0), specs))


@pytest.fixture
def hf(checkpoint: Path, tmp_path: Path) -> Path:
    return export_hf(checkpoint, tmp_path / "hf")


@pytest.fixture
def sharded(checkpoint: Path, tmp_path: Path) -> Path:
    return export_hf(checkpoint, tmp_path / "sharded", max_shard_bytes=100_000)


def _shard(folder: Path, k: int) -> Path:
    return next(folder.glob(f"model-{k:05d}-of-*.safetensors"))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:5000])


def _argv(command: str, folder: Path, tmp_path: Path) -> list[str]:
    if command == "import":
        return ["import", str(folder), "--out", str(tmp_path / "out")]
    if command == "generate":
        return ["generate", "--checkpoint", str(folder), "--prompt", "hi", "--max-new-tokens", "1"]
    return [
        *("train", "--model", "gpt-tiny", "--steps", "1", "--seq-len", "32", "--threads", "1"),
        *("--global-batch", "4", "--micro-batches", "2", "--no-progress"),
        *("--metrics-file", str(tmp_path / "metrics.jsonl"), "--init-from", str(folder)),
    ]


# A corrupt or incomplete weights file.


@pytest.mark.parametrize("command", ["import", "generate", "train"])
def test_a_truncated_safetensors_file_is_named_with_the_fix_by_each_command(
    hf: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    _truncate(hf / "model.safetensors")
    code, err = cli_error(_argv(command, hf, tmp_path), capsys)
    assert code == 2
    assert err.startswith(f"meshpipe: error: {hf / 'model.safetensors'} {CORRUPT}")
    assert err.rstrip().endswith("re-download or re-export it")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("command", ["import", "generate", "train"])
def test_a_truncated_shard_of_a_sharded_folder_is_named_by_each_command(
    sharded: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    _truncate(_shard(sharded, 3))
    code, err = cli_error(_argv(command, sharded, tmp_path), capsys)
    assert code == 2
    assert f"{_shard(sharded, 3)} {CORRUPT}" in err


def test_a_truncated_shard_is_named_by_the_source_every_rank_reads(sharded: Path) -> None:
    """Each pipeline rank reads its own tensors through HFSource: its error names the file."""
    _truncate(_shard(sharded, 2))
    source = HFSource(sharded)
    name = next(n for n in sorted(source.names) if source.where(n) == str(_shard(sharded, 2)))
    with pytest.raises(CheckpointError, match=f"{_shard(sharded, 2)} is corrupt or truncated"):
        source.get(name)


def test_a_shard_missing_a_tensor_its_index_places_there_is_named(
    sharded: Path, tmp_path: Path
) -> None:
    shard = _shard(sharded, 2)
    tensors = load_file(shard)
    dropped = sorted(tensors)[0]
    del tensors[dropped]
    save_file(tensors, shard)
    with pytest.raises(CheckpointError) as refused:
        import_hf(sharded, tmp_path / "out")
    assert str(refused.value).startswith(f"{shard} lacks tensor {dropped!r}, which ")
    assert "re-download or re-export it" in str(refused.value)


def test_a_shard_the_index_points_at_but_missing_is_named(sharded: Path, tmp_path: Path) -> None:
    shard = _shard(sharded, 4)
    shard.unlink()
    with pytest.raises(CheckpointError, match=f"points at {shard.name}, which does not exist"):
        import_hf(sharded, tmp_path / "out")


def test_a_file_missing_a_tensor_the_model_needs_is_refused_as_incomplete(
    hf: Path, tmp_path: Path
) -> None:
    tensors = load_file(hf / "model.safetensors")
    del tensors["transformer.h.0.ln_1.weight"]
    save_file(tensors, hf / "model.safetensors")
    with pytest.raises(CheckpointError, match="lacks 1 of the model's tensors"):
        import_hf(hf, tmp_path / "out")


# A broken config.json.


def test_a_config_json_that_is_not_json_is_named_as_corrupt(
    hf: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (hf / "config.json").write_text('{"model_type": "gpt2",\n')
    code, err = cli_error(_argv("import", hf, tmp_path), capsys)
    assert code == 2
    assert err.startswith(f"meshpipe: error: {hf / 'config.json'} is unreadable (")


@pytest.mark.parametrize("value", [None, "two", 5], ids=["null", "text", "not-a-divisor"])
def test_a_config_json_with_a_bad_value_names_the_file(
    hf: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], value: object
) -> None:
    config = json.loads((hf / "config.json").read_text())
    config["n_head"] = value
    (hf / "config.json").write_text(json.dumps(config))
    code, err = cli_error(_argv("import", hf, tmp_path), capsys)
    assert code == 2
    assert err.startswith(f"meshpipe: error: {hf / 'config.json'} does not describe a model ")


# Not a Hugging Face folder at all.


def test_import_of_a_missing_folder_says_it_does_not_exist(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, err = cli_error(_argv("import", tmp_path / "nope", tmp_path), capsys)
    assert code == 2
    assert err == f"meshpipe: error: {tmp_path / 'nope'} does not exist\n"


def test_import_of_the_weights_file_asks_for_its_folder(hf: Path, tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="is not a folder: pass the Hugging Face model's"):
        import_hf(hf / "model.safetensors", tmp_path / "out")


def test_import_of_a_folder_without_config_json_says_it_is_not_a_hugging_face_folder(
    tmp_path: Path,
) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(CheckpointError, match="has no config.json, so it is not a Hugging Face"):
        import_hf(tmp_path, tmp_path / "out")


@pytest.mark.parametrize("given", ["step", "root"])
def test_import_of_a_meshpipe_checkpoint_says_the_commands_take_it_directly(
    checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], given: str
) -> None:
    root = tmp_path / "root"
    shutil.copytree(checkpoint, root / checkpoint.name)
    (root / "latest").write_text(checkpoint.name + "\n")
    path = root / checkpoint.name if given == "step" else root
    code, err = cli_error(_argv("import", path, tmp_path), capsys)
    assert code == 2
    assert err.startswith(f"meshpipe: error: {path} is already a meshpipe checkpoint")
    assert f"--init-from {path}` and `meshpipe generate --checkpoint {path}` take it" in err
    assert not (tmp_path / "out").exists()
