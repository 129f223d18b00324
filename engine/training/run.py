"""A training run's pieces that the loop, the checkpoints and resume all touch: the engine
built from the config, the data, the learning-rate schedule and, under --fault-tolerant,
this replica's torchft group (`Run`), with one step, an evaluation, a save and a restore.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

import torch
from torch.optim.lr_scheduler import LambdaLR

from engine.checkpoint import (
    TrainerState,
    has_checkpoint,
    load_checkpoint,
    load_model_weights,
    save_checkpoint,
)
from engine.checkpoint.hf_interop import open_weights
from engine.comm.mesh import Mesh
from engine.comm.replica_group import ReplicaGroup, ReplicaPlace
from engine.runtime.engine import PipelineEngine
from engine.runtime.lr_schedules import lr_multiplier
from engine.runtime.step_stats import StepStats
from engine.training.batches import BatchLoader
from engine.training.config import TrainConfig
from engine.training.loaders import RunData, open_data
from engine.training.preflight import check_before_loading
from engine.training.resume_check import (
    check_resumable,
    keep_new_hyperparameters,
    optimizer_hyperparameters,
)
from engine.training.run_data import tokenizer_files
from models import LayerSpec
from partitioners import Partition

__all__ = ["Run", "build_engine", "open_run", "rank_batch", "say"]


def build_engine(
    config: TrainConfig,
    mesh: Mesh,
    specs: list[LayerSpec],
    partition: Partition,
    replicas: ReplicaGroup | None = None,
) -> PipelineEngine:
    return PipelineEngine(
        specs,
        mesh,
        partition=partition,
        micro_batches=config.schedule.micro_batches,
        schedule=(  # a placement asked for: the schedule under it, as data
            config.schedule.schedule
            if config.schedule.placement is None
            else config.schedule.resolve(mesh.pp)
        ),
        stages_per_rank=config.schedule.stages_per_rank,
        seed=config.run.seed,
        optimizer=config.optimizer,
        timeout_s=config.run.timeout,
        options=config.engine,
        replica_sync=config.replica_sync,
        replicas=replicas,
    )


@dataclass(frozen=True, kw_only=True)
class Run:
    """The pieces of a run that the loop, the checkpoints and resume all touch."""

    config: TrainConfig
    engine: PipelineEngine
    specs: list[LayerSpec]
    partition: Partition
    data: RunData
    scheduler: LambdaLR
    replicas: ReplicaGroup | None = None
    """--fault-tolerant: this replica's torchft group."""

    @property
    def loader(self) -> BatchLoader:
        return self.data.train

    def step(self, step: int) -> tuple[StepStats, float, float]:
        """Train one step; returns its stats, the learning rate it used and its seconds."""
        engine = self.engine
        assert engine.optimizer is not None
        inputs, targets, documents = rank_batch(self.loader, engine, step)
        lr = float(engine.optimizer.param_groups[0]["lr"])
        start = time.perf_counter()
        stats = engine.train_step(inputs, targets, documents)
        self.scheduler.step()
        return stats, lr, time.perf_counter() - start

    def evaluates_at(self, done: int) -> bool:
        """Whether the validation loss is measured after `done` steps."""
        every = self.config.data.eval_every
        due = done == self.config.run.steps or (every > 0 and done % every == 0)
        return self.data.val is not None and due

    def evaluate(self) -> float:
        """Mean validation loss over --eval-batches batches, through the pipeline
        (collective: every rank of the mesh calls it)."""
        assert self.data.val is not None
        losses = [
            self.engine.eval_step(*rank_batch(self.data.val, self.engine, k))
            for k in range(self.config.data.eval_batches)
        ]
        return sum(losses) / len(losses)

    def saves_at(self, done: int) -> bool:
        """Whether a checkpoint is written after `done` steps."""
        config = self.config
        every = config.checkpoint.save_every > 0 and done % config.checkpoint.save_every == 0
        writer = self.replicas is None or self.replicas.place.replica == 0
        due = every or done == config.run.steps
        return config.checkpoint.checkpoint_dir is not None and writer and due

    def save(self, done: int) -> None:
        """Checkpoint after `done` steps, when the config asks for it (collective)."""
        config = self.config
        if config.checkpoint.checkpoint_dir is None or not self.saves_at(done):
            return
        state = TrainerState(
            step=done,
            loader={**self.loader.state_dict(), "position": done},
            scheduler=self.scheduler.state_dict(),
            config=config.flat(),
            loss_scale=self.engine.scaler.state_dict() if self.engine.scaler else {},
            skipped_steps=self.engine.skipped_steps,
            tokenizer=tokenizer_files(self.loader.dataset.info, config.data.tokenizer),
        )
        save_checkpoint(
            self.engine,
            self.specs,
            config.checkpoint.checkpoint_dir,
            state=state,
            keep=config.checkpoint.keep,
        )

    def restore(self) -> int:
        """Resume from `latest` or start from --init-from weights; returns the first step."""
        config, engine = self.config, self.engine
        root = config.checkpoint.checkpoint_dir
        if self.replicas is not None and self.replicas.place.attempt:
            return 0  # a relaunched replica heals from a live one, not from disk
        if config.checkpoint.resume and root is not None and has_checkpoint(root):
            assert engine.optimizer is not None
            check_before_loading(root, config)
            built = optimizer_hyperparameters(engine.optimizer)
            where, state = load_checkpoint(
                engine, self.specs, root, fallback=config.checkpoint.resume_fallback
            )
            changed = check_resumable(state.config, config, state.step, str(where))
            self.scheduler.load_state_dict(state.scheduler)
            if changed:
                keep_new_hyperparameters(engine.optimizer, self.scheduler, built)
                say(engine.mesh, f"continuing with new settings ({changed})")
            self.loader.load_state_dict(state.loader)
            if engine.scaler is not None and state.loss_scale:
                engine.scaler.load_state_dict(state.loss_scale)
            engine.skipped_steps = state.skipped_steps
            say(engine.mesh, f"resumed from step {state.step} ({where})")
            if engine.meetings is not None:
                say(engine.mesh, _SHARED_INNER_STATE)
            return state.step
        if config.checkpoint.init_from is not None:
            source = open_weights(config.checkpoint.init_from, config.model.config())
            load_model_weights(engine, self.specs, source)
            say(engine.mesh, f"initialised from {config.checkpoint.init_from}")
        return 0


_SHARED_INNER_STATE = (
    "every replica resumes with the first replica's inner optimizer state: a checkpoint, "
    "taken at a meeting, keeps one copy of the weights and of that state (exact for plain SGD)"
)


def say(mesh: Mesh, message: str) -> None:
    if mesh.rank == 0:
        print(f"meshpipe: {message}", file=sys.stderr, flush=True)


def rank_batch(
    loader: BatchLoader, engine: PipelineEngine, step: int
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """What this rank's stages read of batch `step`: inputs on the first, targets on the last,
    the document ids on every one when documents are packed."""
    if not (loader.pack_documents or engine.is_first or engine.is_last):
        return None, None, None
    batch = loader.sample(step)
    return batch.inputs, batch.targets, batch.documents


def open_run(
    config: TrainConfig, mesh: Mesh, place: ReplicaPlace | None, partition: Partition
) -> Run:
    replicas = None if place is None else ReplicaGroup(place, timeout_s=config.run.timeout)
    data = open_data(config, dp_rank=mesh.dp_rank if place is None else place.replica)
    specs = config.model.specs()
    engine = build_engine(config, mesh, specs, partition, replicas)
    assert engine.optimizer is not None
    lr = config.optimizer.lr
    multiplier = lr_multiplier(config.learning_rate, total_steps=config.run.steps, lr=lr)
    scheduler = LambdaLR(engine.optimizer, multiplier)
    return Run(
        config=config,
        engine=engine,
        specs=specs,
        partition=partition,
        data=data,
        scheduler=scheduler,
        replicas=replicas,
    )
