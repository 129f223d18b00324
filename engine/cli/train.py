"""`meshpipe train` and `meshpipe plot`: a run's flags (generated from `TrainConfig`), its
launch, what it prints at the end or on Ctrl-C, and its loss curve.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from engine.checkpoint.files import step_dirs
from engine.cli.flags import add_config_flags, flag_values, given_fields
from engine.plan.plan_file import apply_plan
from engine.training.config import TrainConfig
from engine.training.metrics import plot_metrics, plot_target
from engine.training.paths import check_paths, file_in, file_out
from engine.training.resume_check import DECAYING_SCHEDULES

if TYPE_CHECKING:
    from engine.training.loop import TrainResult

__all__ = ["COMMANDS", "Interrupted", "add_parsers", "interrupt_advice", "run", "train_config"]

COMMANDS = ("train", "plot")


def add_parsers(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register `train` and `plot` on `meshpipe`'s subparsers."""
    train = commands.add_parser("train", help="train a model (the default corpus if no --data)")
    add_config_flags(train, TrainConfig)
    train.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    train.add_argument(
        "--deepspeed_config",
        "--deepspeed-config",
        default=None,
        help="a DeepSpeed JSON, run as DeepSpeed runs it (docs/DEEPSPEED.md): each key sets "
        'its flag (a flag given that contradicts it is refused), "auto" takes the flag; a '
        "setting it omits takes the flag if given, else DeepSpeed's default (clipping at 1.0; "
        "with an optimizer: its own betas, eps and weight decay, and a constant lr without a "
        "scheduler)",
    )
    train.add_argument(
        "--plan",
        default=None,
        help="a plan meshpipe plan --emit wrote: its layout's settings (a flag given that "
        "contradicts one is refused)",
    )
    plot = commands.add_parser("plot", help="plot the loss curve of a --metrics-file")
    plot.add_argument("metrics", help="a JSON-lines metrics file written by meshpipe train")
    plot.add_argument("--out", default=None, help="PNG to write (default: METRICS with .png)")


def run(args: argparse.Namespace, argv: Sequence[str]) -> int:
    if args.command == "plot":
        return _plot(args)
    config = train_config(args, argv)
    try:
        return _train(config, args)
    except KeyboardInterrupt:
        raise Interrupted(f"interrupted; {interrupt_advice(config)}") from None


def _plot(args: argparse.Namespace) -> int:
    """`meshpipe plot`: the PNG goes where it overwrites neither the metrics nor a folder."""
    from engine.training.preflight import writable_folder

    target = plot_target(args.metrics, args.out)
    shown = args.out or str(target)
    check_paths([file_in("METRICS", args.metrics), file_out("--out", shown, target)])
    if target.is_dir():
        raise ValueError(f"--out {shown}: {target} is a folder: give a file name")
    writable_folder(target.parent, "--out", shown)
    print(f"wrote {plot_metrics(args.metrics, args.out)}")
    return 0


def train_config(args: argparse.Namespace, argv: Sequence[str]) -> TrainConfig:
    """The config a parsed `train` command line asks for; with --deepspeed_config only the
    flags `argv` gives count, so the JSON's omissions take DeepSpeed's defaults, not ours."""
    fields = flag_values(TrainConfig, args)
    if args.plan:
        if args.deepspeed_config:
            raise ValueError(
                "--plan with --deepspeed_config: both set the layout; give one of them"
            )
        fields = apply_plan(TrainConfig, args.plan, fields, given_fields(TrainConfig, argv))
    if not args.deepspeed_config:
        return TrainConfig.of(**fields)
    given = given_fields(TrainConfig, argv)
    return TrainConfig.from_deepspeed(
        args.deepspeed_config, **{k: v for k, v in fields.items() if k in given}
    )


class Interrupted(Exception):
    """Ctrl-C (or SIGTERM) ended a run: the message says where it can go on from."""


def interrupt_advice(config: TrainConfig) -> str:
    """What an interrupted run kept, and how to continue it."""
    if config.checkpoint.checkpoint_dir is None:
        return "no checkpoint was written (--checkpoint-dir D --save-every N keep progress)"
    saved = step_dirs(Path(config.checkpoint.checkpoint_dir))
    if not saved:
        every = (
            f"every {config.checkpoint.save_every} steps"
            if config.checkpoint.save_every
            else "after the last step"
        )
        return (
            f"it stopped before its first checkpoint ({every}): a smaller --save-every keeps "
            "more of a run"
        )
    return f"the newest checkpoint is {saved[-1]}: the same command with --resume goes on from it"


def _launch(config: TrainConfig, *, progress: bool) -> TrainResult:
    """Rank 0's result of a run on local ranks: a refusal (bad input) is never retried, and
    a failure after the last restart says so and where to resume from."""
    from engine.comm.launch import RankFailed, launch_local
    from engine.training.loop import TrainResult
    from engine.training.workers import Refused, local_worker

    restarts = config.run.max_restarts
    try:
        results = launch_local(local_worker, config.parallel.world_size, config, progress,
                               max_restarts=restarts)  # fmt: skip
    except RankFailed as error:
        if restarts == 0 or error.bad_input:
            raise
        raise RankFailed(
            f"{error}\nmeshpipe: all {restarts} restarts (--max-restarts) were used; "
            f"{interrupt_advice(config)}"
        ) from None
    for rank, value in sorted(results.items()):
        if isinstance(value, Refused):
            raise RankFailed(f"rank {rank} failed: {value.error}", bad_input=True)
    result = results[0]
    assert isinstance(result, TrainResult)
    return result


def _launch_replicas(config: TrainConfig, *, progress: bool) -> TrainResult:
    """--fault-tolerant: each replica a world of its own under a Lighthouse; only a dead
    rank's replica is relaunched. Replica 0's result (or the lowest that finished), after a
    line per replica that was relaunched or lost."""
    from engine.comm.launch import RankFailed
    from engine.comm.replica_launch import (
        check_lighthouse,
        first_failure,
        launch_replicas,
        lighthouse_for,
        require_torchft,
    )
    from engine.training.loop import TrainResult
    from engine.training.workers import Refused, local_worker

    ft, layout = config.fault_tolerance, config.parallel
    require_torchft()
    if ft.lighthouse is not None:
        check_lighthouse(ft.lighthouse)
    with lighthouse_for(ft.lighthouse, join_timeout_s=config.run.timeout) as address:
        run = launch_replicas(
            local_worker,
            (config, progress),
            ranks=layout.pp * layout.tp,
            replicas=layout.dp,
            only=ft.replica_id,
            lighthouse=address,
            max_restarts=config.run.max_restarts,
        )
    if not run.results:
        raise first_failure(run)
    for replica, ranks in sorted(run.results.items()):
        for rank, value in sorted(ranks.items()):
            if isinstance(value, Refused):
                raise RankFailed(
                    f"replica {replica} rank {rank} failed: {value.error}", bad_input=True
                )
        result = ranks[0]
        if replica in run.relaunches:
            assert isinstance(result, TrainResult)
            print(
                f"meshpipe: replica {replica} was relaunched {run.relaunches[replica]} time(s) "
                f"and missed {result.missed_steps} steps (healed from a live replica)",
                file=sys.stderr,
            )
    for error in run.lost.values():
        print(f"meshpipe: lost for good (--max-restarts): {error}", file=sys.stderr)
    result = run.results[min(run.results)][0]
    assert isinstance(result, TrainResult)
    return result


def _train(config: TrainConfig, args: argparse.Namespace) -> int:
    from engine.comm.launch import is_launched
    from engine.training.preflight import preflight, reshard_choice, with_reshard_choice
    from engine.training.workers import train_worker

    ranks = config.parallel.world_size
    preflight(config, args.deepspeed_config)
    choice = reshard_choice(config)
    if choice is not None:
        config = with_reshard_choice(config, choice)
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"meshpipe: {choice.line}", file=sys.stderr)
    if config.fault_tolerance.fault_tolerant:
        if is_launched():
            raise ValueError(
                "--fault-tolerant under torchrun or deepspeed: each replica must be a world of "
                "its own, which meshpipe's launcher starts; run meshpipe train directly (with "
                "--lighthouse and --replica-id on each machine)"
            )
        result = _launch_replicas(config, progress=not args.no_progress)
    elif ranks > 1 and not is_launched():
        result = _launch(config, progress=not args.no_progress)
    else:
        if is_launched():
            _check_launcher(config)
        result = train_worker(config, not args.no_progress)
        if int(os.environ.get("RANK", "0")) != 0:
            return 0
    _print_result(config, result)
    return 0


def _check_launcher(config: TrainConfig) -> None:
    """Under torchrun or deepspeed: the launcher's world must be the mesh's, and restarts are
    the launcher's to make."""
    from engine.comm.mesh import launcher_world_size

    ranks = config.parallel.world_size
    if launcher_world_size() != ranks:
        raise ValueError(
            f"--pp {config.parallel.pp} × --dp {config.parallel.dp} × --tp "
            f"{config.parallel.tp} = {ranks} ranks, but "
            f"the launcher started {launcher_world_size()}: make them equal"
        )
    if config.run.max_restarts and int(os.environ.get("RANK", "0")) == 0:
        print(
            f"meshpipe: --max-restarts {config.run.max_restarts} is for meshpipe's own "
            "launcher; under torchrun or deepspeed give the launcher's own (torchrun "
            "--max-restarts)",
            file=sys.stderr,
        )


def _print_result(config: TrainConfig, result: TrainResult) -> None:
    """The run's last line: its loss (and validation loss), speed and bubble; or why there
    was nothing to train."""
    if not result.losses:
        more = (
            " with --resume-with-new-hparams (the learning rate schedule decays over --steps)"
            if config.learning_rate.lr_schedule in DECAYING_SCHEDULES
            else ""
        )
        print(
            f"nothing to train: the checkpoint is at step {result.first_step} and --steps is "
            f"{config.run.steps} (give a larger --steps{more} to train on)"
        )
        return
    val = "" if result.val_loss is None else f", validation loss {result.val_loss:.4f}"
    print(
        f"final loss {result.final_loss:.4f}{val} after {config.run.steps} steps "
        f"({result.tokens_per_s:,.0f} tokens/s, bubble {result.mean_bubble:.1%})"
    )
