"""Checks that span sections: a layout that fits its model, schedule and batch. `TrainConfig`
and `MemoryConfig` run the same checks, so a layout is refused in the same words by
`meshpipe train`, `memory` and `plan`."""

from __future__ import annotations

from engine.config.batch import BatchConfig
from engine.config.engine_options import EngineOptions
from engine.config.fields import require
from engine.config.model import ModelChoice
from engine.config.parallel import ParallelConfig
from engine.config.schedule import ScheduleConfig
from engine.schedule import Schedule, split_units

__all__ = ["check_layout"]


def check_layout(
    *,
    model: ModelChoice,
    parallel: ParallelConfig,
    schedule: ScheduleConfig,
    batch: BatchConfig,
    engine: EngineOptions,
) -> Schedule:
    """The compute schedule the layout runs, once every cross-section rule holds."""
    batch.micro_batch_size(parallel.dp, schedule.micro_batches)
    resolved = schedule.resolve(parallel.pp)
    require(
        not (engine.compile and any(split_units(row) for row in resolved.rows)),
        f"--compile with schedule {schedule.schedule}: its split backward defers each Linear's "
        "weight gradient, which a compiled layer hides; use 1f1b, gpipe, interleaved_1f1b "
        "or looped_bfs with --compile, or drop --compile",
    )
    layers = len(model.specs())
    stages = parallel.pp * schedule.stages_per_rank
    require(
        stages <= layers,
        f"cannot split {model.model}'s {layers} layers into {stages} stages: "
        f"use fewer pipeline ranks or stages per rank (at most {layers} stages)",
    )
    context = model.config().max_seq_len
    require(
        batch.seq_len <= context,
        f"seq_len={batch.seq_len} is longer than {model.model}'s context of {context} tokens: "
        f"use --seq-len {context} or less",
    )
    outside = [s for s in engine.recompute_stages or () if not 0 <= s < stages]
    require(not outside, f"recompute stages {outside} are outside 0..{stages - 1}")
    return resolved
