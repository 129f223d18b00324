"""Loading a checkpoint into any layout, all or nothing.

Loading stages everything first: each rank reads and checks its own stages' tensors (a tied
weight under its lowest layer's name), the ranks agree that all of them succeeded, and only
then is anything copied into parameters and optimizers; a bad checkpoint never leaves a
partly loaded model. Rank 0 chooses the candidate checkpoints for every rank.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.checkpoint.agree import everywhere, rank0_decides
from engine.checkpoint.atomic import sha256_file
from engine.checkpoint.files import (
    MODEL_INDEX,
    OPTIM_INDEX,
    RESUME_FALLBACK_FIX,
    TRAINER_FILE,
    CheckpointError,
    TensorReader,
    TrainerState,
    checkpoint_candidates,
    model_config_dict,
    read_json,
    read_trainer,
    step_dirs,
)
from engine.checkpoint.manifest import verify_manifest
from engine.checkpoint.outer_state import read_outer_momenta
from engine.checkpoint.rng_state import restore_rng, rng_file
from engine.checkpoint.weights import (
    TensorSource,
    check_names,
    copy_into,
    like,
    read_module_weights,
    read_optimizer_state,
    read_sharded_state,
)
from engine.runtime.engine import PipelineEngine
from models import LayerSpec

__all__ = ["load_checkpoint", "load_model_weights"]


@dataclass(frozen=True, kw_only=True)
class _Staged:
    """Everything one rank will apply, read and checked but not yet applied."""

    weights: list[tuple[torch.nn.Parameter, torch.Tensor]]
    optimizer: dict[str, Any] | None
    rng: dict[str, Any] | None
    trainer: TrainerState
    sharded_state: tuple[dict[int, dict[str, Any]], list[dict[str, Any]]] | None = None
    """Under ZeRO: every parameter's whole optimizer state and the groups' hyper-parameters."""
    outer: dict[int, torch.Tensor] | None = None
    """DiLoCo: the outer momentum buffers (local shards by parameter id), when saved."""

    def apply(self, engine: PipelineEngine) -> None:
        sharded = getattr(engine, "sharded", None)
        if sharded is not None:
            state, hyper = self.sharded_state or (None, None)
            masters = {id(p): t.to(torch.float32) for p, t in self.weights}
            sharded.load(masters, state, hyper)
            if self.rng is not None:
                restore_rng(self.rng)
            return
        with torch.no_grad():
            for param, tensor in self.weights:
                copy_into(param, tensor)
        if self.optimizer is not None and engine.optimizer is not None:
            engine.optimizer.load_state_dict(_placed(engine.optimizer, self.optimizer))
        _rejoin_meetings(engine, self.outer)
        if self.rng is not None:
            restore_rng(self.rng)


def _rejoin_meetings(engine: PipelineEngine, outer: dict[int, torch.Tensor] | None) -> None:
    """Semi-synchronous replicas: the loaded weights are the last meeting's (DiLoCo's anchors),
    with the outer momentum the checkpoint kept (from zero when it kept none); a parameter
    server's masters become the loaded weights."""
    server = getattr(engine, "param_server", None)
    if server is not None:
        server.reload()
    meetings = getattr(engine, "meetings", None)
    if meetings is None:
        return
    meetings.reset_anchors()
    if outer is not None and meetings.outer is not None:
        meetings.load_momenta(outer)


def _placed(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> dict[str, Any]:
    """A state dict whose per-parameter tensors are placed as their parameters (ZeRO-3's
    shards; unchanged otherwise)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    placed = {
        index: {key: like(params[index], value) for key, value in entry.items()}
        for index, entry in state["state"].items()
    }
    return {**state, "state": placed}


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
    order = layout.get("mesh_order", "pp,dp,tp")  # the only order before --mesh-order
    saved = (layout.get("pp"), layout.get("dp"), layout.get("tp", 1), order)
    mesh = engine.mesh
    if saved != (mesh.pp, mesh.dp, mesh.tp, ",".join(mesh.order)):
        return None
    name = rng_file(engine.mesh.rank)
    want = trainer.get("rng", {}).get(name)
    if want is None or sha256_file(directory / name) != want:
        raise CheckpointError(f"{directory / name}: missing, or its sha256 differs from trainer")
    return read_json(directory / name)


def _stage(
    engine: PipelineEngine, specs: Sequence[LayerSpec], directory: Path, weights_only: bool
) -> _Staged:
    read = (TRAINER_FILE, MODEL_INDEX)  # and, to resume, this rank's share of the rest:
    rest = (OPTIM_INDEX, rng_file(engine.mesh.rank))  # not every rank's RNG file on every rank
    verify_manifest(directory, read if weights_only else (*read, *rest))
    trainer = read_trainer(directory)
    _check_model(trainer, specs, directory)
    reader = TensorReader(directory, MODEL_INDEX)
    check_names(reader, specs)
    sharded = getattr(engine, "sharded", None)
    exact = sharded is None  # ZeRO keeps low-precision weights beside the stored fp32 masters
    weights = [
        pair
        for stage in engine.stages.values()
        for pair in read_module_weights(stage.module, specs, reader, exact_dtype=exact)
    ]
    optimizer = None
    sharded_state = None
    if not weights_only and sharded is not None:
        modules = [stage.module for stage in engine.stages.values()]
        optim = TensorReader(directory, OPTIM_INDEX)
        sharded_state = read_sharded_state(sharded, modules, specs, optim)
    elif not weights_only and engine.optimizer is not None:
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
    modules = [stage.module for stage in engine.stages.values()]
    outer = None if weights_only else read_outer_momenta(modules, specs, directory)
    return _Staged(
        weights=weights,
        optimizer=optimizer,
        rng=rng,
        trainer=state,
        sharded_state=sharded_state,
        outer=outer,
    )


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
    for directory in rank0_decides(lambda: checkpoint_candidates(path, fallback=fallback)):
        try:
            read = functools.partial(_stage, engine, specs, directory, weights_only)
            staged, _ = everywhere(f"loading {directory}", read)
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

    pairs, _ = everywhere(f"loading weights from {source.where('')}", read)
    sharded = getattr(engine, "sharded", None)
    if sharded is not None:
        sharded.load({id(p): t.to(torch.float32) for p, t in pairs}, None)
        return
    with torch.no_grad():
        for param, tensor in pairs:
            copy_into(param, tensor)
    _rejoin_meetings(engine, None)
