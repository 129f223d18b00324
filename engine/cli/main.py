"""`meshpipe` command line: `train` and `data`.

The `train` flags are generated from `TrainConfig`'s fields and field docstrings, so the CLI,
the config and its documentation never drift apart.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import itertools
import os
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from engine.checkpoint.files import step_dirs
from engine.cli.checkpoint import COMMANDS as CHECKPOINT_COMMANDS
from engine.cli.checkpoint import add_commands as add_checkpoint_commands
from engine.cli.checkpoint import run_command as run_checkpoint_command
from engine.cli.schedule import add_schedule_parser, run_schedule
from engine.comm.launch import RankFailed
from engine.memory.report import add_memory_parser, run_memory
from engine.training.config import TrainConfig
from engine.training.data import prepare, token_file_pair
from engine.training.metrics import plot_metrics
from engine.training.resume_check import DECAYING_SCHEDULES

__all__ = ["build_parser", "main", "train_config"]


def _field_docs(cls: type) -> dict[str, str]:
    """Docstrings written under each field of a dataclass."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, after in itertools.pairwise(body):
        is_doc = isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and is_doc:
            docs[node.target.id] = str(after.value.value)
    return docs


def _add_config_flags(
    parser: argparse.ArgumentParser, cls: type, *, omit_defaults: bool = False
) -> None:
    """One flag per field; with `omit_defaults` a flag not given leaves no attribute."""
    docs = _field_docs(cls)
    for field in dataclasses.fields(cls):
        flag = "--" + field.name.replace("_", "-")
        default = argparse.SUPPRESS if omit_defaults else field.default
        if str(field.type) == "bool":
            help_text = f"{docs.get(field.name, '')} (default: off)"
            parser.add_argument(
                flag, dest=field.name, action="store_true", default=default, help=help_text
            )
            continue
        kind: Any = {"int": int, "float": float}.get(str(field.type), str)
        parser.add_argument(
            flag,
            dest=field.name,
            type=kind,
            default=default,
            help=f"{docs.get(field.name, '')} (default: {field.default})",
        )


def _given_fields(argv: Sequence[str]) -> set[str]:
    """The `TrainConfig` fields a `train` command line sets, even to their default values."""
    parser = argparse.ArgumentParser(add_help=False)
    _add_config_flags(parser, TrainConfig, omit_defaults=True)
    given, _ = parser.parse_known_args(argv)
    return set(vars(given))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="meshpipe", description="Pipeline-parallel training of decoder LLMs."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    train = commands.add_parser("train", help="train a model (the default corpus if no --data)")
    _add_config_flags(train, TrainConfig)
    train.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    train.add_argument(
        "--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS
    )
    train.add_argument(
        "--deepspeed_config",
        "--deepspeed-config",
        default=None,
        help="a DeepSpeed JSON: its batch, optimizer, scheduler, precision, clipping, ZeRO, "
        "partition, recompute and seed keys override the flags above; a setting it omits "
        "takes the flag if given, else DeepSpeed's default (clipping at 1.0; with an "
        "optimizer: its own betas, eps and weight decay, and a constant lr without a scheduler)",
    )
    plot = commands.add_parser("plot", help="plot the loss curve of a --metrics-file")
    plot.add_argument("metrics", help="a JSON-lines metrics file written by meshpipe train")
    plot.add_argument("--out", default=None, help="PNG to write (default: METRICS with .png)")
    plan = commands.add_parser("plan", help="show how a model splits into pipeline stages")
    plan.add_argument("--model", default="gpt-tiny", help="a registered model name")
    plan.add_argument("--pp", type=int, default=2, help="number of pipeline stages")
    plan.add_argument("--partition", default="balanced", help="partition method")
    plan.add_argument(
        "--cost-model", default="flops", help="costs balanced: parameters|flops|activations|time"
    )
    plan.add_argument("--micro-batch-size", type=int, default=1, help="sequences per micro-batch")
    plan.add_argument("--seq-len", type=int, default=128, help="tokens per sequence")
    add_schedule_parser(commands)
    add_memory_parser(commands)
    data = commands.add_parser("data", help="prepare token files")
    data_commands = data.add_subparsers(dest="data_command", required=True)
    prep = data_commands.add_parser("prepare", help="turn text files into a token file")
    prep.add_argument("source", help="a text file or a folder of them")
    prep.add_argument("--out", required=True, help="output prefix (writes OUT.bin and OUT.json)")
    prep.add_argument("--max-bytes", type=int, default=None, help="cap on the corpus size")
    add_checkpoint_commands(commands)
    return parser


def train_config(args: argparse.Namespace, argv: Sequence[str]) -> TrainConfig:
    """The config a parsed `train` command line asks for; with --deepspeed_config only the
    flags `argv` gives count, so the JSON's omissions take DeepSpeed's defaults, not ours."""
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    fields = {k: v for k, v in vars(args).items() if k in names}
    if not args.deepspeed_config:
        return TrainConfig(**fields)
    given = _given_fields(argv)
    return TrainConfig.from_deepspeed(
        args.deepspeed_config, **{k: v for k, v in fields.items() if k in given}
    )


class Interrupted(Exception):
    """Ctrl-C (or SIGTERM) ended a run: the message says where it can go on from."""


def _go_on_from(config: TrainConfig) -> str:
    """What an interrupted run kept, and how to continue it."""
    if config.checkpoint_dir is None:
        return "no checkpoint was written (--checkpoint-dir D --save-every N keep progress)"
    saved = step_dirs(Path(config.checkpoint_dir))
    if not saved:
        every = f"every {config.save_every} steps" if config.save_every else "after the last step"
        return (
            f"it stopped before its first checkpoint ({every}): a smaller --save-every keeps "
            "more of a run"
        )
    return f"the newest checkpoint is {saved[-1]}: the same command with --resume goes on from it"


def _run_train(args: argparse.Namespace, argv: Sequence[str]) -> int:
    config = train_config(args, argv)
    try:
        return _train(config, args)
    except KeyboardInterrupt:
        raise Interrupted(f"interrupted; {_go_on_from(config)}") from None


def _train(config: TrainConfig, args: argparse.Namespace) -> int:
    from engine.comm.launch import is_launched, launch_local
    from engine.comm.mesh import launcher_world_size
    from engine.training.loop import train_worker
    from engine.training.preflight import preflight

    ranks = config.pp * config.dp
    preflight(config)
    if ranks > 1 and not is_launched():
        progress = not args.no_progress
        restarts = config.max_restarts
        result = launch_local(train_worker, ranks, config, progress, max_restarts=restarts)[0]
    else:
        if is_launched() and launcher_world_size() != ranks:
            raise ValueError(
                f"--pp {config.pp} × --dp {config.dp} = {ranks} ranks, but the launcher "
                f"started {launcher_world_size()}: make them equal"
            )
        if is_launched() and config.max_restarts and int(os.environ.get("RANK", "0")) == 0:
            print(
                f"meshpipe: --max-restarts {config.max_restarts} is for meshpipe's own launcher; "
                "under torchrun or deepspeed give the launcher's own (torchrun --max-restarts)",
                file=sys.stderr,
            )
        result = train_worker(config, not args.no_progress)
        if int(os.environ.get("RANK", "0")) != 0:
            return 0
    if not result.losses:
        more = (
            " with --resume-with-new-hparams (the learning rate schedule decays over --steps)"
            if config.lr_schedule in DECAYING_SCHEDULES
            else ""
        )
        print(
            f"nothing to train: the checkpoint is at step {result.first_step} and --steps is "
            f"{config.steps} (give a larger --steps{more} to train on)"
        )
        return 0
    print(
        f"final loss {result.final_loss:.4f} after {config.steps} steps "
        f"({result.tokens_per_s:,.0f} tokens/s, bubble {result.mean_bubble:.1%})"
    )
    return 0


def _run_plan(args: argparse.Namespace) -> int:
    from models import get_config, layer_specs
    from partitioners import layer_costs, partition_model

    specs = layer_specs(args.model)
    context = get_config(args.model).max_seq_len
    if args.micro_batch_size < 1 or not 1 <= args.seq_len <= context:
        raise ValueError(
            f"--micro-batch-size {args.micro_batch_size} --seq-len {args.seq_len}: give at least "
            f"1 sequence of 1 to {context} tokens ({args.model}'s context)"
        )
    kwargs = {"batch_size": args.micro_batch_size, "seq_len": args.seq_len}
    partition = partition_model(
        specs, method=args.partition, num_stages=args.pp, cost_model=args.cost_model, **kwargs
    )
    costs = layer_costs(specs, args.cost_model, **kwargs)
    params = [spec.num_parameters() for spec in specs]
    print(
        f"{args.model}: {len(specs)} layers on {args.pp} stages ({args.partition}, "
        f"cost share by {args.cost_model})"
    )
    print(partition.describe(costs=costs, params=params, names=[s.kind for s in specs]))
    return 0


def _run_data(args: argparse.Namespace) -> int:
    bin_path, json_path = token_file_pair(args.out)
    if json_path.is_file():  # checkpoints trained on it refuse to resume on new tokens
        print(f"meshpipe: replacing the token file {bin_path}", file=sys.stderr)
    info = prepare(args.source, args.out, max_bytes=args.max_bytes)
    print(f"wrote {info.num_tokens:,} tokens to {info.bin_path} (header {info.json_path})")
    return 0


def _subcommand(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    """The parser of subcommand `name`: its usage is the one a mistake in its flags needs."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            found: argparse.ArgumentParser = action.choices[name]
            return found
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    args, extra = parser.parse_known_args(argv)
    if extra:
        _subcommand(parser, args.command).error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        if args.command == "train":
            return _run_train(args, argv)
        if args.command == "plan":
            return _run_plan(args)
        if args.command == "schedule":
            return run_schedule(args)
        if args.command == "plot":
            print(f"wrote {plot_metrics(args.metrics, args.out)}")
            return 0
        if args.command == "memory":
            return run_memory(args)
        if args.command in CHECKPOINT_COMMANDS:
            return run_checkpoint_command(args)
        return _run_data(args)
    except ValueError as error:
        parser.exit(2, f"meshpipe: error: {error}\n")
    except RankFailed as error:
        parser.exit(2 if error.bad_input else 1, f"meshpipe: error: {error}\n")
    except OSError as error:
        parser.exit(1, f"meshpipe: error: {error}\n")
    except Interrupted as interrupted:
        parser.exit(130, f"meshpipe: {interrupted}\n")
    except KeyboardInterrupt:
        parser.exit(130, "meshpipe: interrupted\n")
