"""Saving a run on the mesh: atomic, checksummed, under global names any layout can load.

A checkpoint is a directory `step-{N:08d}` (N optimizer steps done) under the run's checkpoint
folder. Every rank writes its part into `.tmp-step-…`: each stage's first replica (dp rank 0)
its `model-stageSSS.safetensors` and `optim-stageSSS.safetensors` under global names, every
rank its `rng-rankRRRRR.json`. Under ZeRO-1/2 the replicas first gather their shards of the fp32
masters and optimizer state, and the first replica writes them per parameter exactly as a
ZeRO-0 run would (fp32 weights, not the low-precision working copies), so every layout loads
every other. (Checkpoints of the former ZeRO-1, `optim-stageSSS-dpDDD.safetensors` per
replica, are read by name like any other.) When all ranks have reported (a gather that is also
the barrier) global rank 0 writes the indexes, `trainer.json` and last the manifest (the sha256
of each of them and of the RNG states), renames the directory into place, and only then moves
the `latest` pointer; rotation deletes the oldest checkpoints after that.
"""

from __future__ import annotations

import json
import shutil
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from engine.checkpoint.agree import CheckpointIOError, everywhere
from engine.checkpoint.atomic import atomic_write_text, fsync_dir, sha256_file
from engine.checkpoint.files import (
    FORMAT,
    LATEST,
    MODEL_INDEX,
    OPTIM_INDEX,
    TRAINER_FILE,
    TRASH_PREFIX,
    ShardRecord,
    TrainerState,
    model_config_dict,
    new_directory,
    step_dir_name,
    step_dirs,
    trash_owner,
    write_index,
    write_shard,
)
from engine.checkpoint.manifest import write_manifest
from engine.checkpoint.outer_state import outer_tensors, write_outer_index
from engine.checkpoint.rng_state import capture_rng, rng_file
from engine.checkpoint.weights import (
    gathered,
    is_sharded,
    optimizer_state,
    sharded_model_tensors,
    sharded_optimizer_state,
    stored_parameters,
)
from engine.runtime.engine import PipelineEngine
from models import LayerSpec

__all__ = ["save_checkpoint", "save_weights"]


def _write_rank(engine: PipelineEngine, specs: Sequence[LayerSpec], tmp: Path) -> dict[str, Any]:
    """This rank's files; returns what rank 0 needs for the indexes."""
    report: dict[str, Any] = {
        "stages": {},
        "model": [],
        "optim": [],
        "optim_meta": [],
        "outer": [],
    }
    rng = tmp / rng_file(engine.mesh.rank)
    atomic_write_text(rng, json.dumps(capture_rng()))
    report["rng"] = (rng.name, sha256_file(rng))
    first_replica = engine.mesh.dp_rank == 0 and engine.mesh.tp_rank == 0
    masters, states, optimizer, groups = _whole_state(engine)  # collective over dp

    for s, stage in engine.stages.items():
        report["stages"][s] = (stage.layers.start, stage.layers.stop)
        params = (
            stored_parameters(stage.module, specs)
            if masters is None
            else sharded_model_tensors(stage.module, specs, masters)
        )
        if first_replica and params:  # no params: only tied copies, stored by a lower stage
            report["model"].append(write_shard(tmp, f"model-stage{s:03d}.safetensors", params))
        if states is not None:
            if first_replica:
                tensors, meta = sharded_optimizer_state(
                    states, stage.module, specs, optimizer=optimizer, groups=groups
                )
                if tensors:
                    name = f"optim-stage{s:03d}.safetensors"
                    report["optim"].append(write_shard(tmp, name, tensors))
                report["optim_meta"].append(meta)
        elif engine.optimizer is not None:
            _write_optimizer(engine, engine.optimizer, specs, tmp, s, report)
        outer = outer_tensors(stage.module, specs, getattr(engine, "meetings", None))
        if first_replica and outer:
            report["outer"].append(write_shard(tmp, f"outer-stage{s:03d}.safetensors", outer))
    return report


def _whole_state(
    engine: PipelineEngine,
) -> tuple[dict[int, Any] | None, dict[int, Any] | None, str, list[dict[str, Any]]]:
    """Under ZeRO, every parameter's fp32 weight and optimizer state whole (gathered over the
    replicas: collective), the optimizer's class name and its groups' hyper-parameters; Nones
    without ZeRO (each replica holds them whole)."""
    sharded = getattr(engine, "sharded", None)
    if sharded is not None:
        name = type(sharded.optimizer).__name__
        return sharded.full_masters(), sharded.full_state(), name, sharded.reference_groups()
    if getattr(engine, "fsdp", None) is None:
        return None, None, "", []
    masters, states = gathered(engine.module.parameters(), engine.optimizer)
    optimizer = engine.optimizer
    groups = [] if optimizer is None else optimizer.param_groups
    hyper = [{k: v for k, v in g.items() if k != "params"} for g in groups]
    return masters, states if optimizer is not None else None, type(optimizer).__name__, hyper


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
    if engine.mesh.tp_rank != 0:  # it took part in gathering the tp shards; rank 0 writes
        return
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
    write_outer_index(tmp, [rec for report in reports for rec in report["outer"]], step)
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
        "layout": {
            "pp": engine.mesh.pp,
            "dp": engine.mesh.dp,
            "tp": engine.mesh.tp,
            "mesh_order": ",".join(engine.mesh.order),
            "schedule": engine.schedule.name,
        },
        "rng": dict(report["rng"] for report in reports),
        "torch": torch.__version__,
    }
    for name, text in state.tokenizer.items():
        atomic_write_text(tmp / name, text)
    atomic_write_text(tmp / TRAINER_FILE, json.dumps(trainer, indent=1) + "\n")
    write_manifest(tmp)
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
    try:
        everywhere(f"preparing {tmp}", lambda: _prepare(root, tmp) if leader else None)
        _, reports = everywhere(
            f"writing {tmp}", lambda: _write_rank(engine, specs, tmp), report=lambda r: r
        )

        def finish() -> None:
            if leader:
                _finish(engine, specs, tmp, reports, state)
                _publish(tmp, final, keep)

        everywhere(f"publishing {final}", finish)
    except CheckpointIOError as error:  # every rank is here: none writes into tmp any more
        if leader:
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointIOError(f"{error}. {_write_fix(root, tmp)}") from None
    return final


def _write_fix(root: Path, tmp: Path) -> str:
    """What a failed write leaves and what to do: the partial folder is gone, so a resume
    on that disk does not fail on it again; `latest` and earlier checkpoints are intact."""
    usage = shutil.disk_usage(root) if root.is_dir() else None
    free = f" ({usage.free / 2**20:,.0f} MiB free now)" if usage else ""
    return (
        f"Nothing was saved at this step (the partial {tmp.name} was removed; earlier "
        f"checkpoints are intact): free space on the disk of --checkpoint-dir {root}{free} "
        "(or fix what the error names), or give another --checkpoint-dir"
    )


def save_weights(
    out: str | Path,
    specs: Sequence[LayerSpec],
    tensors: dict[str, torch.Tensor],
    files: Mapping[str, str] | None = None,
) -> Path:
    """A weights-only checkpoint (one stage, step 0) in one process, e.g. an imported model.

    `tensors` holds the stored names, `files` other files to carry (name → text, e.g. the
    tokenizer's); the directory appears complete or not at all.
    """
    with new_directory(out) as tmp:
        record = write_shard(tmp, "model-stage000.safetensors", tensors)
        write_index(tmp / MODEL_INDEX, [record], {"step": 0, "partition": [0, len(specs)]})
        trainer = {
            "format": FORMAT,
            "step": 0,
            "model": model_config_dict(specs[0].config),
            "partition": [0, len(specs)],
            "layout": {"pp": 1, "dp": 1, "schedule": None},
            "torch": torch.__version__,
        }
        for name, text in (files or {}).items():
            atomic_write_text(tmp / name, text)
        atomic_write_text(tmp / TRAINER_FILE, json.dumps(trainer, indent=1) + "\n")
        write_manifest(tmp)
    return Path(out)
