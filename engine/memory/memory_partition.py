"""`--partition memory`: the fastest contiguous split whose every stage fits the budget, each
split corrected by the exact replay of the one before (`estimate_memory` hands its own in, as
`rank_peaks`, so that this module imports only downward)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from engine.config import format_size, replace_flat, require
from engine.memory.fitting import fitting_partition, least_memory_partition, stage_needs
from engine.memory.memory_config import MemoryConfig
from engine.memory.replay import StageShape
from engine.schedule.schedule import Schedule
from models import LayerSpec
from partitioners import Partition

__all__ = ["replayed_fitting_partition"]

_FITTING_ROUNDS = 4
"""Splits tried, each corrected by the replay of the one before."""


def replayed_fitting_partition(
    config: MemoryConfig,
    specs: Sequence[LayerSpec],
    schedule: Schedule,
    *,
    shape: StageShape,
    rank_peaks: Callable[[MemoryConfig], tuple[int, ...]],
) -> Partition:
    """The fastest split the per-layer sums fit in `config`'s budget; where the replay of
    it (`rank_peaks`, one peak per stage: a rank per stage) disagrees, each stage's excess
    is added to its needs and the split chosen again."""
    require(
        config.engine.recompute_stages is None,
        "--partition memory with --recompute-stages: the split is chosen for one recompute "
        "policy on every stage; give --recompute alone",
    )
    require(
        config.engine.zero_reshard_stages is None,
        "--partition memory with --zero-reshard-stages: the split is chosen for one reshard "
        "mode on every stage; give --zero-reshard alone",
    )
    budget = config.partition.budget
    assert budget is not None  # PartitionConfig requires it with `memory`
    needs = stage_needs(
        specs,
        schedule,
        shape,
        device=config.device,
        dp=config.parallel.dp,
        zero=config.engine.zero,
    )
    extra = [0] * schedule.num_stages
    for _ in range(_FITTING_ROUNDS):
        try:
            partition = fitting_partition(
                specs, needs, schedule.num_stages, budget=budget, shape=shape, extra=extra
            )
        except ValueError:  # by the sums; the replay of the leanest split may disagree
            partition = least_memory_partition(
                specs, needs, schedule.num_stages, shape=shape, extra=extra
            )
        chosen = replace_flat(config, partition=_boundaries(partition), device_memory=None)
        peaks = rank_peaks(chosen)
        if max(peaks) <= budget:
            return partition
        for stage, peak in enumerate(peaks):
            layers = partition.layers_of(stage)
            extra[stage] = peak - needs(stage, layers.start, layers.stop)
    raise ValueError(
        f"--partition memory: no split fits {format_size(budget)} per device (the leanest found "
        f"peaks at {format_size(max(peaks))} in the replay): add pipeline stages, recompute or "
        "shard, or give a larger --device-memory"
    )


def _boundaries(partition: Partition) -> str:
    return "boundaries:" + ",".join(map(str, partition.boundaries))
