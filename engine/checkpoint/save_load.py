"""Saving and loading a run on the mesh: atomic, checksummed, loadable into any layout.

A checkpoint is a directory `step-{N:08d}` (N optimizer steps done) under the run's checkpoint
folder. Every rank writes its part into `.tmp-step-…`: each stage's first replica (dp rank 0)
its `model-stageSSS.safetensors` and `optim-stageSSS.safetensors` under global names, every
rank its `rng-rankRRRRR.json`. Under ZeRO-1 every replica writes the optimizer state of the
parameters it owns, `optim-stageSSS-dpDDD.safetensors`, into the same index. When all ranks
have reported (a gather that is also the barrier) global rank 0 writes the indexes and
`trainer.json`, renames the directory into place, and only then moves the `latest` pointer;
rotation deletes the oldest checkpoints after that.

Loading stages everything first: each rank reads and checks its own stages' tensors (a tied
weight under its lowest layer's name), the ranks agree that all of them succeeded, and only
then is anything copied into parameters and optimizers; a bad checkpoint never leaves a
partly loaded model.
"""

from __future__ import annotations

import functools
import json
import shutil
import sys
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar, cast

import torch
import torch.distributed as dist

from engine.checkpoint.atomic import sha256_file
from engine.checkpoint.files import (
    FORMAT,
    LATEST,
    MODEL_INDEX,
    OPTIM_INDEX,
    RESUME_FALLBACK_FIX,
    TRAINER_FILE,
    TRASH_PREFIX,
    CheckpointError,
    ShardRecord,
    TensorReader,
    atomic_write_text,
    checkpoint_candidates,
    fsync_dir,
    has_checkpoint,
    model_config_dict,
    read_json,
    read_trainer,
    step_dir_name,
    step_dirs,
    trash_owner,
    write_index,
    write_shard,
)
from engine.checkpoint.rng_state import capture_rng, restore_rng
from engine.checkpoint.weights import (
    TensorSource,
    check_names,
    is_sharded,
    optimizer_state,
    read_module_weights,
    read_optimizer_state,
    stored_parameters,
)
from engine.runtime.engine import PipelineEngine
from models import LayerSpec

__all__ = [
    "LATEST",
    "TrainerState",
    "checkpoint_candidates",
    "has_checkpoint",
    "load_checkpoint",
    "load_model_weights",
    "read_trainer",
    "save_checkpoint",
    "step_dir_name",
    "step_dirs",
]

T = TypeVar("T")


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


def _gather(value: object) -> list[Any]:
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [value]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def _rank0_decides(fn: Callable[[], T]) -> T:
    """`fn` on rank 0, its result (or its CheckpointError) on every rank: ranks that each
    read `latest` and list the step folders could see different files (no shared filesystem,
    a save racing the load) and walk different candidates into mismatched collectives."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return fn()
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            box = [(fn(), None)]
        except Exception as error:  # told to every rank, so none waits for the others
            box = [(None, str(error))]
    dist.broadcast_object_list(box, src=0)
    result, failure = box[0]
    if failure is not None:
        raise CheckpointError(failure)
    return cast(T, result)


def _failures(what: str, gathered: list[tuple[Any, str | None]]) -> str:
    return f"{what} failed on " + "; ".join(
        f"rank {rank}: {error}" for rank, (_, error) in enumerate(gathered) if error
    )


def _everywhere(
    what: str, fn: Callable[[], T], report: Callable[[T], Any] = lambda _: None
) -> tuple[T, list[Any]]:
    """Run `fn` on every rank and gather `report(result)`. If any rank failed, every rank
    raises, so no peer is left waiting in a later collective."""
    try:
        result = fn()
    except Exception as error:  # told to every rank, then raised here too
        raise CheckpointError(_failures(what, _gather((None, f"{error}")))) from error
    gathered = _gather((report(result), None))
    if any(error for _, error in gathered):
        raise CheckpointError(_failures(what, gathered))
    return result, [shared for shared, _ in gathered]


def _write_rank(engine: PipelineEngine, specs: Sequence[LayerSpec], tmp: Path) -> dict[str, Any]:
    """This rank's files; returns what rank 0 needs for the indexes."""
    report: dict[str, Any] = {"stages": {}, "model": [], "optim": [], "optim_meta": []}
    rng = tmp / f"rng-rank{engine.mesh.rank:05d}.json"
    atomic_write_text(rng, json.dumps(capture_rng()))
    report["rng"] = (rng.name, sha256_file(rng))
    first_replica = engine.mesh.dp_rank == 0
    for s, stage in engine.stages.items():
        report["stages"][s] = (stage.layers.start, stage.layers.stop)
        params = stored_parameters(stage.module, specs)
        if first_replica and params:  # no params: only tied copies, stored by a lower stage
            report["model"].append(write_shard(tmp, f"model-stage{s:03d}.safetensors", params))
        if engine.optimizer is not None:
            _write_optimizer(engine, engine.optimizer, specs, tmp, s, report)
    return report


def _write_optimizer(
    engine: PipelineEngine,
    optimizer: torch.optim.Optimizer,
    specs: Sequence[LayerSpec],
    tmp: Path,
    s: int,
    report: dict[str, Any],
) -> None:
    """Stage `s`'s optimizer state: from the first replica, or under ZeRO-1 from every replica,
    each the state of the parameters it owns (global names, so the shards never overlap)."""
    sharded = is_sharded(optimizer)
    if not sharded and engine.mesh.dp_rank != 0:
        return
    tensors, meta = optimizer_state(optimizer, engine.stages[s].module, specs)
    if tensors:
        dp = f"-dp{engine.mesh.dp_rank:03d}" if sharded else ""
        report["optim"].append(write_shard(tmp, f"optim-stage{s:03d}{dp}.safetensors", tensors))
    report["optim_meta"].append(meta)


def _prepare(root: Path, tmp: Path) -> None:
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(".tmp-step-*"):
        shutil.rmtree(stale)
    for trash in root.glob(f"{TRASH_PREFIX}step-*"):
        replaced = root / trash_owner(trash)
        if replaced.exists():
            shutil.rmtree(trash)
        else:  # a replacement cut off between its two renames: the previous copy goes back
            trash.rename(replaced)
    tmp.mkdir()


def _write_indexes(tmp: Path, reports: list[dict[str, Any]], step: int) -> list[int]:
    stages = sorted({s: r for report in reports for s, r in report["stages"].items()}.items())
    boundaries = [0, *(stop for _, (_, stop) in stages)]
    model: list[ShardRecord] = [rec for report in reports for rec in report["model"]]
    write_index(tmp / MODEL_INDEX, model, {"step": step, "partition": boundaries})
    metas = [m for report in reports for m in report["optim_meta"]]
    optim: list[ShardRecord] = [rec for report in reports for rec in report["optim"]]
    if metas:
        state_keys = {k: v for m in metas for k, v in m["state_keys"].items()}
        scalars = {k: v for m in metas for k, v in m["scalars"].items()}
        meta = {
            **metas[0],
            "state_keys": dict(sorted(state_keys.items())),
            "scalars": dict(sorted(scalars.items())),
            "step": step,
        }
        write_index(tmp / OPTIM_INDEX, optim, meta)
    return boundaries


def _finish(
    engine: PipelineEngine,
    specs: Sequence[LayerSpec],
    tmp: Path,
    reports: list[dict[str, Any]],
    state: TrainerState,
) -> None:
    trainer = {
        "format": FORMAT,
        "step": state.step,
        "loader": state.loader,
        "scheduler": state.scheduler,
        "config": state.config,
        "loss_scale": state.loss_scale,
        "skipped_steps": state.skipped_steps,
        "model": model_config_dict(specs[0].config),
        "partition": _write_indexes(tmp, reports, state.step),
        "layout": {"pp": engine.mesh.pp, "dp": engine.mesh.dp, "schedule": engine.schedule.name},
        "rng": dict(report["rng"] for report in reports),
        "torch": torch.__version__,
    }
    atomic_write_text(tmp / TRAINER_FILE, json.dumps(trainer, indent=1) + "\n")
    fsync_dir(tmp)


def _publish(tmp: Path, final: Path, keep: int) -> None:
    """Rename into place, then move `latest`, then rotate: `latest` is always complete."""
    root = final.parent
    if final.exists():
        trash = root / f"{TRASH_PREFIX}{final.name}-{uuid.uuid4().hex[:8]}"
        final.rename(trash)
        tmp.rename(final)
        shutil.rmtree(trash)
    else:
        tmp.rename(final)
    fsync_dir(root)
    atomic_write_text(root / LATEST, final.name + "\n")
    if keep > 0:
        complete = step_dirs(root)
        for old in [p for p in complete if p != final][: max(0, len(complete) - keep)]:
            shutil.rmtree(old)


def save_checkpoint(
    engine: PipelineEngine,
    specs: Sequence[LayerSpec],
    root: str | Path,
    *,
    state: TrainerState,
    keep: int = 0,
) -> Path:
    """Write `step-{state.step}` under `root`; collective over every rank of the run.

    Returns once the checkpoint is complete and `latest` names it; `keep` > 0 then deletes all
    but the newest `keep` checkpoints.
    """
    root = Path(root)
    final = root / step_dir_name(state.step)
    tmp = root / f".tmp-{final.name}"
    leader = engine.mesh.rank == 0
    _everywhere(f"preparing {tmp}", lambda: _prepare(root, tmp) if leader else None)
    _, reports = _everywhere(
        f"writing {tmp}", lambda: _write_rank(engine, specs, tmp), report=lambda r: r
    )

    def finish() -> None:
        if leader:
            _finish(engine, specs, tmp, reports, state)
            _publish(tmp, final, keep)

    _everywhere(f"publishing {final}", finish)
    return final


@dataclass(frozen=True, kw_only=True)
class _Staged:
    """Everything one rank will apply, read and checked but not yet applied."""

    weights: list[tuple[torch.nn.Parameter, torch.Tensor]]
    optimizer: dict[str, Any] | None
    rng: dict[str, Any] | None
    trainer: TrainerState

    def apply(self, engine: PipelineEngine) -> None:
        with torch.no_grad():
            for param, tensor in self.weights:
                param.copy_(tensor)
        if self.optimizer is not None and engine.optimizer is not None:
            engine.optimizer.load_state_dict(self.optimizer)
        if self.rng is not None:
            restore_rng(self.rng)


def _check_model(trainer: dict[str, Any], specs: Sequence[LayerSpec], directory: Path) -> None:
    saved, ours = trainer.get("model", {}), model_config_dict(specs[0].config)
    if saved != ours:
        diff = {k: (saved.get(k), ours.get(k)) for k in ours if saved.get(k) != ours.get(k)}
        raise CheckpointError(
            f"{directory / TRAINER_FILE} was saved from another model: (saved, this run) "
            f"differ in {diff}; pick the --model it was trained with"
        )


def _read_rng(directory: Path, trainer: dict[str, Any], engine: PipelineEngine) -> Any:
    layout = trainer.get("layout", {})
    if (layout.get("pp"), layout.get("dp")) != (engine.mesh.pp, engine.mesh.dp):
        return None
    name = f"rng-rank{engine.mesh.rank:05d}.json"
    want = trainer.get("rng", {}).get(name)
    if want is None or sha256_file(directory / name) != want:
        raise CheckpointError(f"{directory / name}: missing, or its sha256 differs from trainer")
    return read_json(directory / name)


def _stage(
    engine: PipelineEngine, specs: Sequence[LayerSpec], directory: Path, weights_only: bool
) -> _Staged:
    trainer = read_trainer(directory)
    _check_model(trainer, specs, directory)
    reader = TensorReader(directory, MODEL_INDEX)
    check_names(reader, specs)
    weights = [
        pair
        for stage in engine.stages.values()
        for pair in read_module_weights(stage.module, specs, reader, exact_dtype=True)
    ]
    optimizer = None
    if not weights_only and engine.optimizer is not None:
        modules = [stage.module for stage in engine.stages.values()]
        optim = TensorReader(directory, OPTIM_INDEX)
        optimizer = read_optimizer_state(engine.optimizer, modules, specs, optim)
    state = TrainerState(
        step=int(trainer.get("step", 0)),
        loader=trainer.get("loader") or {},
        scheduler=trainer.get("scheduler") or {},
        config=trainer.get("config") or {},
        loss_scale=trainer.get("loss_scale") or {},
        skipped_steps=int(trainer.get("skipped_steps", 0)),
    )
    rng = None if weights_only else _read_rng(directory, trainer, engine)
    return _Staged(weights=weights, optimizer=optimizer, rng=rng, trainer=state)


def load_checkpoint(
    engine: PipelineEngine,
    specs: Sequence[LayerSpec],
    path: str | Path,
    *,
    fallback: bool = False,
    weights_only: bool = False,
) -> tuple[Path, TrainerState]:
    """Load a checkpoint (or what `path`'s `latest` names) into this rank's stages; collective.

    Nothing is applied unless every rank read and checked its part. With `fallback`, a
    checkpoint that fails is skipped for the previous complete one (said on stderr).
    """
    failures: list[str] = []
    for directory in _rank0_decides(lambda: checkpoint_candidates(path, fallback=fallback)):
        try:
            read = functools.partial(_stage, engine, specs, directory, weights_only)
            staged, _ = _everywhere(f"loading {directory}", read)
        except CheckpointError as error:
            failures.append(str(error))
            if engine.mesh.rank == 0 and fallback:
                print(f"meshpipe: {error}; trying an older checkpoint", file=sys.stderr)
            continue
        staged.apply(engine)
        return directory, staged.trainer
    older = [p for p in step_dirs(Path(path)) if p.name < directory.name] if not fallback else []
    if older:
        failures.append(f"the previous complete checkpoint is {older[-1]}: {RESUME_FALLBACK_FIX}")
    raise CheckpointError("\n".join(failures))


def load_model_weights(
    engine: PipelineEngine, specs: Sequence[LayerSpec], source: TensorSource
) -> None:
    """Weights only, from any source (a checkpoint or a Hugging Face folder); collective."""

    def read() -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
        check_names(source, specs)
        return [
            pair
            for stage in engine.stages.values()
            for pair in read_module_weights(stage.module, specs, source, exact_dtype=False)
        ]

    pairs, _ = _everywhere(f"loading weights from {source.where('')}", read)
    with torch.no_grad():
        for param, tensor in pairs:
            param.copy_(tensor)
