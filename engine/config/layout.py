"""Checks that span sections: a layout that fits its model, schedule and batch. `TrainConfig`
and `MemoryConfig` run the same checks, so a layout is refused in the same words by
`meshpipe train`, `memory` and `plan`."""

from __future__ import annotations

from engine.config.batch import BatchConfig
from engine.config.engine_options import EngineOptions
from engine.config.fields import require
from engine.config.model import ModelChoice
from engine.config.parallel import ParallelConfig, check_tensor_parallel_shape
from engine.config.schedule import PartitionConfig, ScheduleConfig
from engine.schedule import Schedule, split_units

__all__ = ["check_budget", "check_layout"]


def check_budget(partition: PartitionConfig, engine: EngineOptions) -> None:
    """--device-memory is read by --partition memory and by ZeRO-3's --zero-reshard auto;
    given to neither, it would be ignored."""
    require(
        partition.device_memory is None
        or partition.by_memory
        or (engine.zero == 3 and engine.zero_reshard == "auto"),
        f"--device-memory {partition.device_memory} is the budget of --partition memory and "
        f"of --zero 3's --zero-reshard auto, which this run uses neither of (--partition "
        f"{partition.partition}, --zero {engine.zero}, --zero-reshard {engine.zero_reshard}): "
        "add --partition memory or --zero 3, or drop --device-memory",
    )


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
    require(
        not (engine.zero_reshard == "micro-batch" and any(split_units(r) for r in resolved.rows)),
        f"--zero-reshard micro-batch with schedule {schedule.schedule}: its split backward runs "
        "each weight gradient after the layer's backward has resharded it and reduced its "
        "gradient; use 1f1b, gpipe, interleaved_1f1b or looped_bfs, or --zero-reshard step",
    )
    layers = len(model.specs())
    stages = parallel.pp * schedule.stages_per_rank
    require(
        stages <= layers,
        f"cannot split {model.name}'s {layers} layers into {stages} stages: "
        f"use fewer pipeline ranks or stages per rank (at most {layers} stages)",
    )
    context = model.config().max_seq_len
    require(
        batch.seq_len <= context,
        f"seq_len={batch.seq_len} is longer than {model.name}'s context of {context} tokens: "
        f"use --seq-len {context} or less",
    )
    outside = [s for s in engine.recompute_stages or () if not 0 <= s < stages]
    require(not outside, f"recompute stages {outside} are outside 0..{stages - 1}")
    outside = [s for s in engine.zero_reshard_stages or () if not 0 <= s < stages]
    require(
        not outside,
        f"--zero-reshard-stages {outside} are outside the run's stages 0..{stages - 1}: name "
        "stages among them",
    )
    require(
        parallel.tp > 1 or not engine.sequence_parallel,
        "--sequence-parallel splits the sequence over the tensor-parallel ranks of each stage, "
        f"but --tp is {parallel.tp}: add --tp 2 (or more), or drop --sequence-parallel",
    )
    if parallel.tp > 1:
        check_tensor_parallel_shape(model.name, model.config(), parallel.tp)
        _check_tensor_parallel_options(parallel, batch, engine)
    return resolved


def _check_tensor_parallel_options(
    parallel: ParallelConfig, batch: BatchConfig, engine: EngineOptions
) -> None:
    """What tensor parallelism cannot run (yet), refused by name with the way out."""
    tp = parallel.tp
    require(
        not engine.sequence_parallel or batch.seq_len % tp == 0,
        f"--sequence-parallel with --tp {tp} and --seq-len {batch.seq_len}: each tensor-parallel "
        f"rank holds an equal 1/{tp} of the sequence; use a --seq-len that is a multiple of {tp}",
    )
    require(
        parallel.pp == 1 or batch.seq_len % tp == 0,
        f"--tp {tp} with --seq-len {batch.seq_len}: between pipeline stages each tensor-parallel "
        f"rank sends 1/{tp} of the activation, split along the sequence; use a --seq-len that "
        f"is a multiple of {tp}",
    )
