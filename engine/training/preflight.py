"""Checks a run passes before its first step: its partition, the paths it writes, its token
file and --init-from weights against the model, and the settings of the checkpoint it resumes.

A launcher runs `preflight` before starting ranks, so a mistake fails once, in the terminal,
rather than in every rank or, for an output path, after the last step.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from engine.checkpoint.files import (
    TRAINER_FILE,
    CheckpointError,
    checkpoint_candidates,
    has_checkpoint,
    read_trainer,
    step_dirs,
)
from engine.checkpoint.hf_interop import open_weights
from engine.checkpoint.manifest import unverified_note, verify_manifest
from engine.checkpoint.owner import check_folder_free
from engine.comm.mesh import check_device
from engine.memory.estimate import MemoryConfig, resolve
from engine.memory.reshard import (
    ReshardChoice,
    choose_reshard,
    choose_reshard_without_budget,
    with_reshard,
)
from engine.runtime.weight_grads import runs_whole_backward_at_input
from engine.schedule.actions import split_units
from engine.training.config import TrainConfig
from engine.training.loaders import open_data
from engine.training.monitors import check_monitors
from engine.training.paths import (
    PathUse,
    check_paths,
    checkpoint_in,
    checkpoint_root,
    file_in,
    file_out,
    folder_out,
    token_file,
)
from engine.training.resume_check import check_resumable
from engine.training.run_data import check_model_tokenizer, open_training_data
from engine.training.tokenizer import ByteTokenizer, Tokenizer
from models import LayerSpec
from partitioners import Partition, partition_model

__all__ = [
    "check_before_loading",
    "check_data",
    "check_outputs",
    "preflight",
    "reshard_choice",
    "run_paths",
    "stage_partition",
    "with_reshard_choice",
    "writable_folder",
]


def stage_partition(config: TrainConfig, specs: Sequence[LayerSpec]) -> Partition:
    """The run's stages, partitioned as the config asks (`memory`: by the memory model, for
    the run's own device, precision, schedule and ZeRO level)."""
    parallel, schedule = config.parallel, config.schedule
    if config.partition.by_memory:
        return _memory_partition(config)
    return partition_model(
        specs,
        method=config.partition.partition,
        num_stages=parallel.pp * schedule.stages_per_rank,
        cost_model=config.partition.cost_model,
        batch_size=config.batch.micro_batch_size(parallel.dp, schedule.micro_batches),
        seq_len=config.batch.seq_len,
    )


def _memory_config(config: TrainConfig) -> MemoryConfig:
    """The run's layout as the memory model sees it, on the run's own device."""
    gpu = config.run.device != "cpu" and torch.cuda.is_available()
    return MemoryConfig(
        model=config.model,
        parallel=config.parallel,
        schedule=config.schedule,
        partition=config.partition,
        batch=config.batch,
        engine=config.engine,
        optimizer=config.optimizer,
        replica_sync=config.replica_sync,
        device="cuda" if gpu else "cpu",
    )


def _memory_partition(config: TrainConfig) -> Partition:
    try:
        return resolve(_memory_config(config)).partition
    except ValueError as error:
        raise ValueError(f"--partition memory: {error}") from None


def reshard_choice(config: TrainConfig) -> ReshardChoice | None:
    """ZeRO-3's `--zero-reshard auto` resolved by the memory model against --device-memory
    (None where the run gives a mode, or is not ZeRO-3)."""
    engine, budget = config.engine, config.partition.budget
    if engine.zero != 3 or engine.zero_reshard != "auto":
        return None
    if budget is None:
        return choose_reshard_without_budget()
    try:
        memory = _memory_config(config)
    except ValueError as error:
        raise ValueError(
            f"--zero-reshard auto with --device-memory {config.partition.device_memory} "
            f"chooses by the memory model, which cannot model this run ({error}): give "
            "--zero-reshard step or micro-batch"
        ) from None
    return choose_reshard(memory, budget)


def with_reshard_choice(config: TrainConfig, choice: ReshardChoice) -> TrainConfig:
    """The run with `auto` resolved: the chosen mode and stages, and --device-memory dropped
    unless --partition memory still reads it (`with_reshard`)."""
    return with_reshard(config, choice.reshard, choice.stages)


def writable_folder(folder: Path, flag: str, given: str) -> None:
    """Create `folder` now, so a path that cannot be written fails before the first step,
    not after the last one."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise ValueError(
            f"{flag} {given}: {folder} is a file, not a folder: pick another path"
        ) from None
    except OSError as error:
        raise ValueError(f"{flag} {given}: cannot create {folder} ({error.strerror})") from None
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {given}: {folder} is not writable: pick another path")


def run_paths(config: TrainConfig, deepspeed_config: str | None = None) -> list[PathUse]:
    """Every path a run reads or writes, by the flag that names it."""
    run, monitor, ckpt = config.run, config.monitor, config.checkpoint
    named = [
        ("--metrics-file", run.metrics_file, file_out),
        ("--trace", run.trace, file_out),
        ("--flops-profile-file", monitor.flops_profile_file, file_out),
        ("--tensorboard-dir", monitor.tensorboard_dir, folder_out),
        ("--csv-dir", monitor.csv_dir, folder_out),
        ("--checkpoint-dir", ckpt.checkpoint_dir, checkpoint_root),
        ("--data", config.data.data, token_file),
        ("--val-data", config.data.val_data, token_file),
        ("--init-from", ckpt.init_from, checkpoint_in),
        ("--deepspeed_config", deepspeed_config, file_in),
    ]
    uses = [make(flag, given) for flag, given, make in named if given is not None]
    if Path(config.schedule.schedule).is_file():
        uses.append(file_in("--schedule", config.schedule.schedule))
    return uses


def check_outputs(config: TrainConfig, deepspeed_config: str | None = None) -> None:
    """Every path the run writes (checkpoints, metrics, trace, FLOPs report, monitors) can be
    written and is none of the paths it reads or another it writes, each monitor's package is
    installed, and a new run does not write over another run's checkpoints (same-named steps
    would be replaced and --keep would delete the rest)."""
    check_paths(run_paths(config, deepspeed_config))
    root = config.checkpoint.checkpoint_dir
    if root is not None:
        _not_a_checkpoint(Path(root))
        writable_folder(Path(root), "--checkpoint-dir", root)
        if not config.checkpoint.resume and has_checkpoint(root):
            newest = step_dirs(Path(root))
            held = f" (newest {newest[-1].name})" if newest else ""
            raise ValueError(
                f"--checkpoint-dir {root} already holds a run's checkpoints{held}: add --resume "
                "to continue it, or give another --checkpoint-dir to start a new run"
            )
    for flag, path in (
        ("--metrics-file", config.run.metrics_file),
        ("--trace", config.run.trace),
        ("--flops-profile-file", config.monitor.flops_profile_file),
    ):
        if path is None:
            continue
        if Path(path).is_dir():
            raise ValueError(f"{flag} {path} is a folder: give a file name")
        writable_folder(Path(path).parent, flag, path)
    check_monitors(config.monitor)
    for flag, folder in (
        ("--tensorboard-dir", config.monitor.tensorboard_dir),
        ("--csv-dir", config.monitor.csv_dir),
    ):
        if folder is not None:
            writable_folder(Path(folder), flag, folder)


def _not_a_checkpoint(root: Path) -> None:
    """--checkpoint-dir is the folder that holds a run's `step-NNNNNNNN` checkpoints; given one
    checkpoint (a step folder, or what `meshpipe import` wrote) the run would find nothing to
    resume, train from scratch and nest new checkpoints inside it."""
    if not (root / TRAINER_FILE).is_file():
        return
    parent = root.parent
    resume = (
        f"to continue its run, give its folder: --checkpoint-dir {parent} --resume; "
        if has_checkpoint(parent)
        else ""
    )
    raise ValueError(
        f"--checkpoint-dir {root} is a checkpoint, not a folder of checkpoints: {resume}to "
        f"start a new run from its weights, use --init-from {root} with a new --checkpoint-dir"
    )


def check_data(config: TrainConfig) -> None:
    """The token ids, their vocabulary and tokenizer, against the model and the checkpoint a
    run starts from (the default corpus is byte tokens)."""
    data, checkpoint = config.data, config.checkpoint
    tokenizer: Tokenizer | None = ByteTokenizer()
    if data.data is not None:
        _, tokenizer = open_training_data(
            data.data,
            vocab_size=data.vocab_size,
            tokenizer=data.tokenizer,
            model_vocab=config.model.config().vocab_size,
            model=config.model.name,
        )
    where = f"--data {data.data}" if data.data else "the default corpus"
    root = checkpoint.checkpoint_dir
    if checkpoint.resume and root is not None and has_checkpoint(root):
        check_model_tokenizer("--resume from", root, tokenizer, where)
    elif checkpoint.init_from is not None:
        check_model_tokenizer("--init-from", checkpoint.init_from, tokenizer, where)


def preflight(config: TrainConfig, deepspeed_config: str | None = None) -> None:
    """Everything a launcher checks before starting ranks; says when a new run replaces an
    existing metrics file."""
    check_device(config.run.device)
    specs = config.model.specs()
    note = whole_backward_note(config, stage_partition(config, specs), specs)
    if note is not None:
        print(f"meshpipe: {note}", file=sys.stderr)
    check_outputs(config, deepspeed_config)
    check_data(config)  # token ids, vocabulary and tokenizer against the model and checkpoint
    open_data(config)  # documents to pack, a validation split, enough tokens
    metrics = config.run.metrics_file
    if metrics is not None and not config.checkpoint.resume and Path(metrics).is_file():
        print(f"meshpipe: --metrics-file {metrics} exists: this run replaces it", file=sys.stderr)
    if config.checkpoint.init_from is not None:
        open_weights(config.checkpoint.init_from, config.model.config())
    root = config.checkpoint.checkpoint_dir
    if root is not None:
        check_folder_free(root)
    if config.checkpoint.resume and root is not None and has_checkpoint(root):
        check_before_loading(root, config)


def whole_backward_note(
    config: TrainConfig, partition: Partition, specs: Sequence[LayerSpec]
) -> str | None:
    """Where a split-backward schedule's stages run their backward whole at I, their W empty
    (`runs_whole_backward_at_input`): the schedule still runs, but those W fill no bubble, so
    it does not run as its name promises. Said before the ranks start; None where no stage."""
    schedule = config.schedule.resolve(config.parallel.pp)
    split = sorted({stage for stage, _ in split_units(a for row in schedule.rows for a in row)})
    recomputed = [s for s in split if config.engine.recompute_of(s) != "none"]
    tied = [
        s
        for s in split
        if s not in recomputed
        and runs_whole_backward_at_input(specs, partition.layers_of(s), "none")
    ]
    reasons = []
    if recomputed:
        reasons.append(f"{_stages(recomputed)} recompute{'s' if len(recomputed) == 1 else ''}")
    if tied:
        reasons.append(f"{_stages(tied)} hold{'s' if len(tied) == 1 else ''} both ends of a tie")
    if not reasons:
        return None
    fix = " (--recompute-stages can leave them out)" if recomputed else ""
    return (
        f"--schedule {config.schedule.schedule}: {' and '.join(reasons)}, so each runs its "
        "whole backward at I and its W are empty: no weight gradients are left there to fill "
        f"the bubbles, and meshpipe plan prices it so{fix}"
    )


def _stages(stages: Sequence[int]) -> str:
    return f"stage{'s' if len(stages) > 1 else ''} {', '.join(map(str, stages))}"


def check_before_loading(root: str, config: TrainConfig) -> None:
    """Refuse changed settings before loading: a checkpoint of another optimizer or model
    fails to load, which would hide the plain reason and its fix."""
    try:
        directory = checkpoint_candidates(root, fallback=config.checkpoint.resume_fallback)[0]
        verify_manifest(directory, (TRAINER_FILE,))
        trainer = read_trainer(directory)
    except CheckpointError:
        return  # loading reports it, or falls back to an older checkpoint
    note = unverified_note(directory)
    if note is not None:
        print(f"meshpipe: {note}", file=sys.stderr)
    check_resumable(trainer.get("config", {}), config, trainer.get("step", 0), str(directory))
