"""The training loop behind `meshpipe train`: one process or a pp × dp mesh of them.

Every rank runs this loop. Only the first stage reads inputs and only the last reads targets;
global rank 0 shows the progress bar and writes the metrics.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from engine.config import TrainConfig
from engine.data import BatchLoader, TokenDataset, default_corpus, load_tokens
from engine.engine import PipelineEngine, StepStats
from engine.mesh import Mesh, init_mesh
from engine.metrics import MetricsLog
from engine.optim import build_optimizer, lr_factor
from models import get_config, layer_specs
from partitioners import partition_model

__all__ = ["TrainResult", "open_dataset", "train", "train_worker"]


@dataclass(frozen=True, kw_only=True)
class TrainResult:
    """What a finished run reports."""

    losses: tuple[float, ...]
    """Mean loss of every step, in order."""
    tokens_per_s: float
    """Throughput over the whole run after the first step."""
    bubbles: tuple[float, ...] = ()
    """Measured pipeline bubble of every step."""

    @property
    def final_loss(self) -> float:
        return self.losses[-1]


def open_dataset(config: TrainConfig) -> TokenDataset:
    """The run's token data, checked against the model's vocabulary."""
    dataset = load_tokens(config.data) if config.data else load_tokens(default_corpus().bin_path)
    vocab = get_config(config.model).vocab_size
    if dataset.info.vocab_size > vocab:
        raise ValueError(
            f"data {dataset.info.bin_path} has vocabulary {dataset.info.vocab_size} but "
            f"{config.model} embeds only {vocab} tokens: use a model with a larger vocabulary"
        )
    return dataset


def _set_threads(config: TrainConfig, mesh: Mesh) -> None:
    if config.threads:
        torch.set_num_threads(config.threads)
    elif mesh.world_size > 1:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", mesh.world_size))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))


def _build_engine(config: TrainConfig, mesh: Mesh) -> PipelineEngine:
    specs = layer_specs(config.model)
    partition = partition_model(
        specs,
        method=config.partition,
        num_stages=config.pp,
        batch_size=config.global_batch // (config.dp * config.micro_batches),
        seq_len=config.seq_len,
    )
    return PipelineEngine(
        specs,
        mesh,
        partition=partition,
        micro_batches=config.micro_batches,
        schedule=config.schedule,
        seed=config.seed,
        optimizer=lambda module: build_optimizer(
            module, name=config.optimizer, lr=config.lr, weight_decay=config.weight_decay
        ),
        timeout_s=config.timeout,
    )


def train(config: TrainConfig, *, progress: bool = True) -> TrainResult:
    """Train `config.model` on this rank's share of the mesh (one process when pp·dp = 1)."""
    mesh = init_mesh(config.pp, config.dp, timeout_s=config.timeout)
    _set_threads(config, mesh)
    dataset = open_dataset(config)
    loader = BatchLoader(
        dataset,
        seq_len=config.seq_len,
        global_batch=config.global_batch,
        seed=config.seed,
        dp_rank=mesh.dp_rank,
        dp_size=config.dp,
    )
    engine = _build_engine(config, mesh)
    assert engine.optimizer is not None
    schedule = torch.optim.lr_scheduler.LambdaLR(
        engine.optimizer,
        lambda step: lr_factor(
            step,
            schedule=config.lr_schedule,
            warmup_steps=config.warmup_steps,
            total_steps=config.steps,
            min_ratio=config.min_lr_ratio,
        ),
    )
    tokens_per_step = config.global_batch * config.seq_len
    stats: list[StepStats] = []
    wall: list[float] = []
    leader = mesh.rank == 0
    path = config.metrics_file if leader else None
    with MetricsLog(total_steps=config.steps, path=path, progress=progress and leader) as log:
        for step in range(config.steps):
            needs_data = engine.is_first or engine.is_last
            inputs, targets = loader.batch_at(step) if needs_data else (None, None)
            lr = engine.optimizer.param_groups[0]["lr"]
            start = time.perf_counter()
            result = engine.train_step(inputs, targets)
            schedule.step()
            wall.append(time.perf_counter() - start)
            stats.append(result)
            log.record(
                step=step,
                loss=result.loss,
                lr=lr,
                step_s=wall[-1],
                tokens_per_s=tokens_per_step / wall[-1],
                bubble=result.bubble,
            )
    timed = sum(wall[1:])
    steady = tokens_per_step * (len(wall) - 1) / timed if timed else 0.0
    return TrainResult(
        losses=tuple(s.loss for s in stats),
        tokens_per_s=steady,
        bubbles=tuple(s.bubble for s in stats),
    )


def train_worker(config: TrainConfig, progress: bool) -> TrainResult:
    """Entry point of each locally launched rank."""
    try:
        return train(config, progress=progress)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
