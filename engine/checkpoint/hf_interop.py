"""Hugging Face interchange: read an HF GPT-2, Llama, Mistral or Qwen2 folder as a tensor
source under our global names, export a checkpoint as one, import one as a checkpoint. The
names each side understands are `hf_names`', the `config.json` `hf_configs`'.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from engine.checkpoint.files import (
    MODEL_INDEX,
    PASS_IT_FIX,
    TRAINER_FILE,
    CheckpointError,
    TensorReader,
    atomic_write_text,
    checkpoint_candidates,
    expected_names,
    has_checkpoint,
    model_config_from_dict,
    new_directory,
    read_json,
    read_trainer,
    write_index,
    write_shard,
)
from engine.checkpoint.hf_configs import hf_config, model_config_from_hf
from engine.checkpoint.hf_names import hf_rules
from engine.checkpoint.manifest import verify_manifest
from engine.checkpoint.save import save_weights
from engine.checkpoint.weights import TensorSource, check_names
from models import GPTConfig, ModelConfig

__all__ = [
    "TOKENIZER_FILES",
    "HFSource",
    "export_hf",
    "import_hf",
    "model_folder",
    "open_model",
    "open_weights",
    "tokenizer_files",
]

HF_CONFIG = "config.json"
HF_SINGLE = "model.safetensors"
HF_INDEX = "model.safetensors.index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
"""The tokenizer files a checkpoint or an HF folder carries beside the weights (the data's
tokenizer, written by `engine.training.tokenizer`); none for the byte tokenizer."""


def _corrupt(path: Path, error: SafetensorError) -> CheckpointError:
    return CheckpointError(f"{path} is corrupt or truncated ({error}): re-download or re-export it")


def _hf_files(folder: Path, prefix: str) -> dict[str, tuple[str, str]]:
    """HF tensor name -> (file, name in the file), from the sharded index or the single file.

    Files saved from the base model (GPT-2 on the Hub: `h.0.…`, `wte.weight`) lack the
    `transformer.` / `model.` prefix; they are found under the prefixed name too.
    """
    if (folder / HF_INDEX).is_file():
        weight_map = read_json(folder / HF_INDEX).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{folder / HF_INDEX} has no weight_map")
    elif (folder / HF_SINGLE).is_file():
        try:
            with safe_open(str(folder / HF_SINGLE), framework="pt") as f:
                weight_map = dict.fromkeys(f.keys(), HF_SINGLE)
        except SafetensorError as error:
            raise _corrupt(folder / HF_SINGLE, error) from None
    else:
        raise CheckpointError(f"{folder} holds neither {HF_SINGLE} nor {HF_INDEX}")
    files = {name: (file, name) for name, file in weight_map.items()}
    for name, file in weight_map.items():
        files.setdefault(prefix + name, (file, name))
    return files


def _check_hf_folder(folder: Path) -> None:
    """`folder` is a directory with a `config.json`, or a CheckpointError saying what it is."""
    if not folder.exists():
        raise CheckpointError(f"{folder} does not exist")
    if not folder.is_dir():
        raise CheckpointError(
            f"{folder} is not a folder: pass the Hugging Face model's folder, the one holding "
            f"{HF_CONFIG} and {HF_SINGLE} (or {HF_INDEX} and its shards)"
        )
    if not (folder / HF_CONFIG).is_file():
        raise CheckpointError(
            f"{folder} has no {HF_CONFIG}, so it is not a Hugging Face model folder: pass the "
            f"folder holding {HF_CONFIG} and {HF_SINGLE} (or {HF_INDEX} and its shards)"
        )


class HFSource:
    """An HF folder seen under our stored names (a `TensorSource`); tensors read lazily."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        _check_hf_folder(self.folder)
        hf = read_json(self.folder / HF_CONFIG)
        self.config = model_config_from_hf(hf, self.folder / HF_CONFIG)
        prefix = "transformer." if isinstance(self.config, GPTConfig) else "model."
        self._files = _hf_files(self.folder, prefix)
        rules = hf_rules(self.config)
        self._rule = {ours: (rule, j) for rule in rules for j, ours in enumerate(rule.ours)}
        self._names = frozenset(n for n, (r, _) in self._rule.items() if r.hf in self._files)
        self._cache: tuple[str, torch.Tensor] | None = None

    @property
    def names(self) -> frozenset[str]:
        """Our stored names whose HF tensor the folder holds."""
        return self._names

    def where(self, name: str) -> str:
        rule = self._rule.get(name)
        found = self._files.get(rule[0].hf) if rule else None
        return str(self.folder / found[0]) if found else str(self.folder)

    def _read(self, hf: str) -> torch.Tensor:
        if self._cache is None or self._cache[0] != hf:
            file, stored = self._files[hf]
            self._cache = (hf, self._read_file(self.folder / file, stored))
        return self._cache[1]

    def _read_file(self, path: Path, stored: str) -> torch.Tensor:
        """Tensor `stored` of a file the index (or the single file's own header) lists."""
        index = self.folder / HF_INDEX
        if not path.is_file():
            raise CheckpointError(
                f"{index} points at {path.name}, which does not exist: "
                "the download is incomplete; re-download or re-export the folder"
            )
        try:
            with safe_open(str(path), framework="pt") as f:
                tensor = f.get_tensor(stored) if stored in f.keys() else None  # noqa: SIM118
        except SafetensorError as error:
            raise _corrupt(path, error) from None
        if tensor is None:
            raise CheckpointError(
                f"{path} lacks tensor {stored!r}, which {index} places there: the folder is "
                "incomplete or its files are mixed up; re-download or re-export it"
            )
        return tensor

    def get(self, name: str) -> torch.Tensor:
        if name not in self.names:
            raise CheckpointError(f"tensor {name!r} has no source in {self.folder}")
        rule, j = self._rule[name]
        tensor = self._read(rule.hf)
        tensor = tensor.T if rule.transpose else tensor
        return tensor.chunk(len(rule.ours))[j].contiguous()


def _is_hf_folder(path: Path) -> bool:
    """A sharded HF folder has an index under the same name as ours (`HF_INDEX ==
    MODEL_INDEX`), so the index cannot tell them apart: an HF folder has `config.json` and no
    `trainer.json`."""
    return (path / HF_CONFIG).is_file() and not (path / TRAINER_FILE).is_file()


def model_folder(path: str | Path) -> Path:
    """The folder holding the model `path` names: an HF folder, or the checkpoint a
    checkpoint root's `latest` points at."""
    path = Path(path)
    return path if _is_hf_folder(path) else checkpoint_candidates(path, fix=PASS_IT_FIX)[0]


def tokenizer_files(path: str | Path) -> dict[str, str]:
    """The tokenizer files (name → text) of the model at `path` (a checkpoint verified by
    its manifest); empty when it carries none."""
    folder = model_folder(path)
    found = [name for name in TOKENIZER_FILES if (folder / name).is_file()]
    if found and not _is_hf_folder(folder):
        verify_manifest(folder, tuple(found))
    return {name: (folder / name).read_text(encoding="utf-8") for name in found}


def open_model(path: str | Path) -> tuple[ModelConfig, TensorSource]:
    """The model config and weights of an HF folder or a meshpipe checkpoint (or its root)."""
    path = Path(path)
    if _is_hf_folder(path):
        source = HFSource(path)
        return source.config, source
    directory = checkpoint_candidates(path, fix=PASS_IT_FIX)[0]
    verify_manifest(directory, (TRAINER_FILE, MODEL_INDEX))
    config = model_config_from_dict(read_trainer(directory).get("model", {}))
    return config, TensorReader(directory, MODEL_INDEX)


def open_weights(path: str | Path, config: ModelConfig) -> TensorSource:
    """Weights for a run of `config`'s model; a different shape is an error naming both."""
    saved, source = open_model(path)
    if saved != config:
        raise CheckpointError(
            f"{path} holds {saved}, but the run builds {config}: pick the matching --model "
            f"(--model hf:{path} for a Hugging Face folder's own shape, --model-config FILE for "
            "any other)"
        )
    return source


def _shards(tensors: dict[str, torch.Tensor], max_bytes: int) -> list[dict[str, torch.Tensor]]:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    return shards


def export_hf(checkpoint: str | Path, out: str | Path, *, max_shard_bytes: int = 5 << 30) -> Path:
    """Write `config.json` and `model.safetensors` (sharded with an index past
    `max_shard_bytes`) that `transformers` loads as GPT2LMHeadModel / LlamaForCausalLM, and
    the checkpoint's tokenizer files, which `AutoTokenizer` loads.

    Everything is checked before the first byte is written, and the folder appears at `out`
    complete or not at all."""
    if (
        isinstance(max_shard_bytes, bool)
        or not isinstance(max_shard_bytes, int)
        or max_shard_bytes < 1
    ):
        raise ValueError(
            f"max_shard_bytes={max_shard_bytes!r} (--max-shard-bytes) must be a positive int: "
            f"the largest shard in bytes, e.g. {5 << 30} (5 GiB, the default when left out)"
        )
    config, source = open_model(checkpoint)
    hf = hf_config(config)  # refuses what HF cannot represent before any tensor is read
    check_names(source, config.layer_specs())
    tensors = {}
    for rule in hf_rules(config):
        joined = torch.cat([source.get(name) for name in rule.ours])
        tensors[rule.hf] = (joined.T if rule.transpose else joined).contiguous()
    shards = _shards(tensors, max_shard_bytes)
    with new_directory(out) as tmp:
        if len(shards) == 1:
            write_shard(tmp, HF_SINGLE, shards[0])
        else:
            n = len(shards)
            files = [f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)]
            records = [write_shard(tmp, f, s) for f, s in zip(files, shards, strict=True)]
            write_index(tmp / HF_INDEX, records, {})
        atomic_write_text(tmp / HF_CONFIG, json.dumps(hf, indent=1) + "\n")
        for name, text in tokenizer_files(checkpoint).items():
            atomic_write_text(tmp / name, text)
    return Path(out)


def import_hf(folder: str | Path, out: str | Path) -> Path:
    """A meshpipe checkpoint (weights only, one stage) from an HF GPT-2 or Llama folder."""
    folder = Path(folder)
    if (folder / TRAINER_FILE).is_file() or has_checkpoint(folder):
        raise CheckpointError(
            f"{folder} is already a meshpipe checkpoint, not a Hugging Face folder: nothing to "
            f"import; `meshpipe train --init-from {folder}` and "
            f"`meshpipe generate --checkpoint {folder}` take it directly"
        )
    source = HFSource(folder)
    specs = source.config.layer_specs()
    check_names(source, specs)
    tensors = {name: source.get(name) for name in sorted(expected_names(specs))}
    return save_weights(out, specs, tensors, tokenizer_files(folder))
