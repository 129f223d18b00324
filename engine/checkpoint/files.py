"""The on-disk format of a checkpoint: safetensors shards under global names, HF-shaped indexes
carrying a sha256 per shard, and a reader that verifies every shard it opens.

No torch.distributed here: each rank calls these on the files it owns, so the format can be
tested, imported and exported in one process. Names are global (`layers.{i}.…`) and a weight
tied across layers is stored once, under the name of its lowest layer, so any layout can load
any checkpoint.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from engine.checkpoint.atomic import (
    atomic_write_text,
    fsync_dir,
    fsync_file,
    make_shareable,
    sha256_file,
)
from models import GPTConfig, LayerSpec, LlamaConfig, ModelConfig

__all__ = [
    "FORMAT",
    "LATEST",
    "MODEL_INDEX",
    "OPTIM_INDEX",
    "PASS_IT_FIX",
    "RESUME_FALLBACK_FIX",
    "TRAINER_FILE",
    "TRASH_PREFIX",
    "CheckpointError",
    "ShardRecord",
    "TensorReader",
    "TrainerState",
    "atomic_write_text",
    "canonical_name",
    "check_sha256",
    "checkpoint_candidates",
    "expected_names",
    "fsync_dir",
    "has_checkpoint",
    "model_config_dict",
    "model_config_from_dict",
    "new_directory",
    "read_json",
    "read_trainer",
    "step_dir_name",
    "step_dirs",
    "trash_owner",
    "write_index",
    "write_shard",
]

FORMAT = "meshpipe-checkpoint/1"
MODEL_INDEX = "model.safetensors.index.json"
OPTIM_INDEX = "optim.safetensors.index.json"
TRAINER_FILE = "trainer.json"
LATEST = "latest"
_STEP_DIR = re.compile(r"^step-(\d{8})$")


@dataclass(frozen=True, kw_only=True)
class TrainerState:
    """What the training loop resumes besides weights and optimizer state."""

    step: int
    """Optimizer steps completed; the resumed run continues with this step."""
    loader: dict[str, int] = field(default_factory=dict)
    """`BatchLoader.state_dict()` at `step`."""
    scheduler: dict[str, Any] = field(default_factory=dict)
    """The LR scheduler's `state_dict()`."""
    config: dict[str, Any] = field(default_factory=dict)
    """The run's `TrainConfig` as a dict (for the record, and for `generate`/`export`)."""
    loss_scale: dict[str, float] = field(default_factory=dict)
    """fp16's `LossScaler.state_dict()` (empty in other precisions): the scale the next step
    uses and how close it is to growing, so a resumed run skips and steps as this one would."""
    skipped_steps: int = 0
    """Optimizer steps skipped so far for a non-finite loss or gradient."""
    tokenizer: dict[str, str] = field(default_factory=dict)
    """The files of the tokenizer the data was made with (name → text: `tokenizer.json` and
    `tokenizer_config.json`), written beside the weights; empty for the byte tokenizer."""


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete, corrupt or does not fit the model."""


def check_sha256(path: Path, want: str, *, recorded_in: Path) -> None:
    """`path`'s bytes against the digest `recorded_in` holds for it: a mismatch is a corrupt,
    edited or replaced file, named with both."""
    got = sha256_file(path)
    if got != want:
        raise CheckpointError(
            f"{path}: sha256 {got[:12]}… does not match {want[:12]}… in {recorded_in}; "
            "the file is corrupt, edited or replaced"
        )


@dataclass(frozen=True, kw_only=True)
class ShardRecord:
    """What a rank wrote: one safetensors file, its checksum and the names it holds."""

    file: str
    """File name inside the checkpoint directory."""
    sha256: str
    """Hex digest of the whole file, checked by every reader that opens it."""
    size: int
    """Bytes of tensor data (the index's `total_size` sums these)."""
    names: tuple[str, ...]
    """Tensor names stored in the file."""


def write_shard(directory: Path, file: str, tensors: Mapping[str, torch.Tensor]) -> ShardRecord:
    """Write `tensors` as one safetensors file, fsync it, and return its record."""
    path = directory / file
    cpu = {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}
    save_file(cpu, str(path), metadata={"format": "pt"})
    make_shareable(path)  # safetensors writes through a 0600 temp file
    fsync_file(path)
    size = sum(t.numel() * t.element_size() for t in cpu.values())
    return ShardRecord(file=file, sha256=sha256_file(path), size=size, names=tuple(sorted(cpu)))


def write_index(path: Path, records: Sequence[ShardRecord], metadata: Mapping[str, Any]) -> None:
    """An index shaped like HF's `model.safetensors.index.json`, with a sha256 per shard."""
    weight_map = {name: r.file for r in records for name in r.names}
    meta = {
        **metadata,
        "format": FORMAT,
        "total_size": sum(r.size for r in records),
        "sha256": {r.file: r.sha256 for r in sorted(records, key=lambda r: r.file)},
    }
    body = {"metadata": meta, "weight_map": dict(sorted(weight_map.items()))}
    atomic_write_text(path, json.dumps(body, indent=1) + "\n")


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from `path`; anything else is a CheckpointError naming the file."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{path} does not exist: the checkpoint is incomplete") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CheckpointError(f"{path} is unreadable ({error}): the file is corrupt") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{path} does not hold a JSON object: the file is corrupt")
    return value


class TensorReader:
    """The tensors of one index. A shard is opened only when a name it holds is asked for, and
    its sha256 is checked against the index once, before any tensor of it is returned."""

    def __init__(self, directory: Path, index_file: str) -> None:
        self.directory, self.index_path = directory, directory / index_file
        index = read_json(self.index_path)
        weight_map, meta = index.get("weight_map"), index.get("metadata")
        if not isinstance(weight_map, dict) or not isinstance(meta, dict):
            raise CheckpointError(f"{self.index_path} lacks 'weight_map' or 'metadata'")
        self.weight_map: dict[str, str] = weight_map
        self.metadata: dict[str, Any] = meta
        self._digests: dict[str, str] = dict(meta.get("sha256", {}))
        self.opened: set[str] = set()

    @property
    def names(self) -> frozenset[str]:
        return frozenset(self.weight_map)

    def _verified(self, file: str) -> Path:
        path = self.directory / file
        if file in self.opened:
            return path
        if not path.is_file():
            raise CheckpointError(f"{self.index_path} points at {file}, which does not exist")
        want = self._digests.get(file)
        if want is None:
            raise CheckpointError(f"{self.index_path} has no sha256 for {file}")
        check_sha256(path, want, recorded_in=self.index_path)
        self.opened.add(file)
        return path

    def where(self, name: str) -> str:
        """The shard holding `name`, or the index when no shard does."""
        file = self.weight_map.get(name)
        return str(self.directory / file) if file else str(self.index_path)

    def get(self, name: str) -> torch.Tensor:
        """The tensor `name`, from its verified shard."""
        file = self.weight_map.get(name)
        if file is None:
            raise CheckpointError(f"tensor {name!r} is missing from {self.index_path}")
        path = self._verified(file)
        try:
            with safe_open(str(path), framework="pt") as f:
                if name not in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                    raise CheckpointError(f"{path}: tensor {name!r} is missing from the file")
                return f.get_tensor(name)
        except SafetensorError as error:
            raise CheckpointError(f"{path}: unreadable safetensors file ({error})") from None


def canonical_name(specs: Sequence[LayerSpec], name: str) -> str:
    """The stored name of parameter `name`: a tied copy maps to its tie group's lowest layer."""
    prefix, index, local = name.split(".", 2)
    spec = specs[int(index)]
    if spec.tie_key is None or local != spec.tied_param:
        return name
    first = next(i for i, s in enumerate(specs) if s.tie_key == spec.tie_key)
    return f"{prefix}.{first}.{specs[first].tied_param}"


def expected_names(specs: Sequence[LayerSpec]) -> frozenset[str]:
    """Stored names of the whole model (built on meta: no memory)."""
    names = set()
    for i, spec in enumerate(specs):
        for local, _ in spec.build("meta").named_parameters():
            names.add(canonical_name(specs, f"layers.{i}.{local}"))
    return frozenset(names)


def model_config_dict(config: ModelConfig) -> dict[str, Any]:
    """The model's shape as JSON, with its family, so a checkpoint rebuilds its own model."""
    family = "gpt" if isinstance(config, GPTConfig) else "llama"
    return {"family": family, **asdict(config)}


def model_config_from_dict(value: Mapping[str, Any]) -> ModelConfig:
    fields = {k: v for k, v in value.items() if k != "family"}
    family = value.get("family")
    try:
        if family == "gpt":
            return GPTConfig(**fields)
        if family == "llama":
            return LlamaConfig(**fields)
    except TypeError as error:
        raise CheckpointError(f"model config {dict(value)} does not build: {error}") from None
    raise CheckpointError(f"model config has family {family!r}; expected 'gpt' or 'llama'")


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


TRASH_PREFIX = ".trash-"
"""A checkpoint being replaced by a new save of the same step waits under this prefix."""


def trash_owner(trash: Path) -> str:
    """The step directory a `.trash-step-NNNNNNNN-xxxxxxxx` folder was the previous copy of."""
    return trash.name.removeprefix(TRASH_PREFIX).rsplit("-", 1)[0]


def step_dirs(root: Path) -> list[Path]:
    """Complete checkpoints under `root` (renamed into place), oldest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and _STEP_DIR.match(p.name)]
    return sorted(found, key=lambda p: p.name)


def has_checkpoint(root: str | Path) -> bool:
    """True when `root` holds a `latest` pointer or any complete checkpoint."""
    root = Path(root)
    return (root / LATEST).is_file() or bool(step_dirs(root))


RESUME_FALLBACK_FIX = "pass --resume-fallback to resume from it"
"""How a resumed `meshpipe train` uses the newest complete checkpoint when `latest` is bad."""
PASS_IT_FIX = "pass that directory instead"
"""How a command that reads one checkpoint (export, generate, --init-from) uses it."""


def _newest_complete(root: Path, fix: str) -> str:
    """The end of an error about `latest`: the checkpoint to use instead, and how."""
    complete = step_dirs(root)
    if not complete:
        return "no complete step-NNNNNNNN directory is left under it"
    return f"the newest complete one is {complete[-1]}: {fix}"


def _latest_target(root: Path, fix: str) -> Path:
    pointer = root / LATEST
    if not pointer.is_file():
        raise CheckpointError(
            f"{root} holds checkpoints but no {LATEST!r} pointer (a save was cut off); "
            + _newest_complete(root, fix)
        )
    name = pointer.read_text(encoding="utf-8").strip()
    previous = sorted(root.glob(f"{TRASH_PREFIX}{name}-*")) if _STEP_DIR.match(name) else []
    if previous and not (root / name).is_dir():
        raise CheckpointError(
            f"{pointer} names {name!r}, but a save replacing it was cut off between two "
            f"renames: its previous copy is {previous[-1]}. Rename that folder to {root / name} "
            "(the next save does it too); or " + _newest_complete(root, fix)
        )
    if not _STEP_DIR.match(name) or not (root / name).is_dir():
        raise CheckpointError(
            f"{pointer} names {name!r}, which is not a checkpoint under {root}; "
            + _newest_complete(root, fix)
        )
    return root / name


def checkpoint_candidates(
    path: str | Path, *, fallback: bool = False, fix: str = RESUME_FALLBACK_FIX
) -> list[Path]:
    """Checkpoint directories to try, best first: `path` itself if it is one, else what its
    `latest` points at, then (with `fallback`) the older complete ones, newest first.

    Without a usable `latest` (and without `fallback`) the error names the newest complete
    checkpoint and ends with `fix`: how the caller's command can use it."""
    path = Path(path)
    if (path / TRAINER_FILE).is_file():
        return [path]
    if not path.exists():
        raise CheckpointError(f"{path} does not exist: give a checkpoint or its folder")
    if not has_checkpoint(path):
        raise CheckpointError(f"{path} holds no checkpoint ({LATEST!r} or step-NNNNNNNN)")
    older = list(reversed(step_dirs(path)))
    try:
        target = _latest_target(path, fix)
    except CheckpointError:
        if fallback and older:
            return older
        raise
    return [target, *(p for p in older if p.name < target.name)] if fallback else [target]


def read_trainer(directory: Path) -> dict[str, Any]:
    """`trainer.json` of a checkpoint, checked for the format."""
    trainer = read_json(directory / TRAINER_FILE)
    if trainer.get("format") != FORMAT:
        raise CheckpointError(
            f"{directory / TRAINER_FILE} has format {trainer.get('format')!r}, not {FORMAT!r}"
        )
    return trainer


@contextlib.contextmanager
def new_directory(out: str | Path) -> Iterator[Path]:
    """A folder that appears at `out` complete or not at all.

    Yields a temporary sibling to write into; on success it is fsynced and renamed to `out`,
    on failure removed, so an error midway never leaves a partial folder that a retry then
    refuses as "not empty". `out` must be absent or empty.
    """
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise CheckpointError(f"{out} exists and is not empty: remove it or choose another --out")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".tmp-{out.name}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        yield tmp
        fsync_dir(tmp)
        if out.exists():
            out.rmdir()
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_dir(out.parent)
