"""The single-process training loop behind `meshpipe train` with one rank."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from engine.config import TrainConfig
from engine.data import BatchLoader, TokenDataset, default_corpus, load_tokens
from engine.metrics import MetricsLog
from engine.optim import build_optimizer, lr_factor
from engine.reference import reference_step
from models import build_layers, get_config, layer_specs

__all__ = ["TrainResult", "open_dataset", "train"]


@dataclass(frozen=True, kw_only=True)
class TrainResult:
    """What a finished run reports."""

    losses: tuple[float, ...]
    """Mean loss of every step, in order."""
    tokens_per_s: float
    """Throughput over the whole run after the first step."""

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


def train(config: TrainConfig, *, progress: bool = True) -> TrainResult:
    """Train `config.model` in this process; the reference every pipeline run matches."""
    if config.threads:
        torch.set_num_threads(config.threads)
    loader = BatchLoader(
        open_dataset(config),
        seq_len=config.seq_len,
        global_batch=config.global_batch,
        seed=config.seed,
    )
    model = build_layers(layer_specs(config.model), seed=config.seed)
    optimizer = build_optimizer(
        model, name=config.optimizer, lr=config.lr, weight_decay=config.weight_decay
    )
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda step: lr_factor(
            step,
            schedule=config.lr_schedule,
            warmup_steps=config.warmup_steps,
            total_steps=config.steps,
            min_ratio=config.min_lr_ratio,
        ),
    )
    tokens_per_step = config.global_batch * config.seq_len
    losses: list[float] = []
    timed = 0.0
    with MetricsLog(total_steps=config.steps, path=config.metrics_file, progress=progress) as log:
        for step in range(config.steps):
            inputs, targets = loader.next_batch()
            lr = optimizer.param_groups[0]["lr"]
            start = time.perf_counter()
            loss = reference_step(
                model, optimizer, inputs, targets, micro_batches=config.micro_batches
            )
            schedule.step()
            elapsed = time.perf_counter() - start
            timed += elapsed if step else 0.0
            losses.append(loss)
            log.record(
                step=step,
                loss=loss,
                lr=lr,
                step_s=elapsed,
                tokens_per_s=tokens_per_step / elapsed,
            )
    steady = tokens_per_step * (config.steps - 1) / timed if timed else 0.0
    return TrainResult(losses=tuple(losses), tokens_per_s=steady)
