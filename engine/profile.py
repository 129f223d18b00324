"""Measured per-stage costs for the simulator: time F, B, I and W of the real stages.

Each stage is built alone (only its layers), run on sample input for a few micro-batches, and
timed per action; the medians become `ActionCosts.per_stage`, so a prediction reflects the
partition's real imbalance.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import torch

from engine.simulate import ActionCosts
from engine.stage import PipelineStage
from models import LayerSpec
from partitioners import Partition

__all__ = ["profile_stage_costs"]


def _profile_stage(
    specs: Sequence[LayerSpec],
    stage_index: int,
    partition: Partition,
    batch_size: int,
    seq_len: int,
    repeats: int,
) -> tuple[float, float, float, float]:
    layers = partition.layers_of(stage_index)
    fused, split = (
        PipelineStage(
            specs, stage=stage_index, layers=layers, num_stages=partition.num_stages, seed=0
        )
        for _ in range(2)
    )
    split.enable_split_backward()
    first = specs[layers.start]
    tokens = torch.randint(0, 256, (batch_size, seq_len))
    sample = first.example_input(batch_size, seq_len, device="cpu")
    samples: list[list[float]] = [[], [], [], []]
    for k in range(repeats + 1):
        fresh = torch.randn(sample.shape).requires_grad_()
        x = (tokens,) if first.input_kind == "tokens" else (fresh,)
        clock = [time.perf_counter()]
        out = fused.forward(k, x, targets=tokens)
        clock.append(time.perf_counter())
        grads = () if fused.is_last else tuple(torch.ones_like(o) for o in out)
        fused.backward(k, grads)
        clock.append(time.perf_counter())
        split.forward(
            k, tuple(t.detach().requires_grad_(t.requires_grad) for t in x), targets=tokens
        )
        clock.append(time.perf_counter())
        split.backward_input(k, grads)
        clock.append(time.perf_counter())
        split.backward_weight(k)
        clock.append(time.perf_counter())
        if k:
            spans = (
                clock[1] - clock[0],
                clock[2] - clock[1],
                clock[4] - clock[3],
                clock[5] - clock[4],
            )
            for bucket, value in zip(samples, spans, strict=True):
                bucket.append(value)
    f, b, i, w = (statistics.median(bucket) for bucket in samples)
    return f, b, i, w


def profile_stage_costs(
    specs: Sequence[LayerSpec],
    partition: Partition,
    *,
    batch_size: int = 1,
    seq_len: int = 128,
    repeats: int = 3,
    comm: float = 0.0,
) -> ActionCosts:
    """Median seconds of F, B, I, W per stage (after a warm-up micro-batch) on this CPU."""
    if repeats < 1:
        raise ValueError(f"repeats={repeats} must be at least 1")
    per_stage = tuple(
        _profile_stage(specs, s, partition, batch_size, seq_len, repeats)
        for s in range(partition.num_stages)
    )
    return ActionCosts(per_stage=per_stage, comm=comm)
