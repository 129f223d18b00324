"""`meshpipe memory`: its flags, and the estimate printed as they ask.

`run` prints the estimate, and on request whether it fits a device (with alternatives if
not, and exit code `DOES_NOT_FIT`), a measured run beside it, or DeepSpeed's and Megatron's
formulas beside it.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from engine.cli.flags import add_config_flags, flag_values, given_fields
from engine.config import replace_flat, require
from engine.config.sizes import parse_size
from engine.memory.estimate import MemoryConfig, estimate_memory, trace_requests
from engine.memory.measure import check_measurable, measure_memory
from engine.memory.report import (
    format_comparison,
    format_json,
    format_measured,
    format_report,
    format_sequence_saving,
    format_suggestions,
)
from engine.memory.reshard import choose_reshard, with_reshard
from engine.memory.suggest import suggest
from engine.memory.trace_store import trace_ahead
from engine.plan.plan_file import apply_plan

__all__ = ["COMMANDS", "DOES_NOT_FIT", "add_parsers", "config_from_args", "run"]

COMMANDS = ("memory",)

_NOT_MEMORY = frozenset(
    {
        *("global_batch", "lr", "weight_decay", "betas", "momentum", "adam_eps"),
        *("clip_grad_norm", "no_nonfinite_guard", "mesh_order"),
        *("sync_every", "outer_lr", "max_staleness"),  # --dp-sync's copies do not depend on them
        "device_memory",  # its own flag below: the fit to check, and --partition memory's budget
    }
)
"""Settings that change no byte of the estimate: not flags of `meshpipe memory`."""

DOES_NOT_FIT = 3
"""Exit code when a rank's estimated peak exceeds `--device-memory`, in text and JSON mode alike,
so a script can tell without parsing (2 is bad input, as for every command; 0 otherwise)."""


def _size_arg(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def add_parsers(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add `meshpipe memory` to the object `ArgumentParser.add_subparsers()` returns."""
    p = subparsers.add_parser(
        "memory",
        help="per-stage memory of a layout, before allocating it",
        description="Per-stage and per-rank peak memory of one training step, estimated "
        "without allocating the model.",
        epilog=f"exit status: 0 when the estimate is printed (and fits --device-memory if "
        f"given), {DOES_NOT_FIT} when a rank's peak exceeds --device-memory (the table and the "
        "alternatives are still printed), 2 on bad input.",
    )
    add_config_flags(p, MemoryConfig, exclude=_NOT_MEMORY)
    p.add_argument("--dtype", dest="precision", default=argparse.SUPPRESS, help="--precision")
    p.add_argument(
        "--global-batch", type=int, default=None, help="sequences per step, all replicas"
    )
    p.add_argument(
        "--micro-batch-size",
        type=int,
        default=None,
        help="sequences per micro-batch (default: 1, or what --global-batch gives)",
    )
    p.add_argument(
        "--device-memory",
        type=_size_arg,
        default=None,
        help=f"e.g. 80GB or 80GiB: say whether the layout fits (exit {DOES_NOT_FIT} if not); "
        "the budget of --partition memory",
    )
    p.add_argument(
        "--measure",
        action="store_true",
        help="also run it for real here (small models; ZeRO and tp as one rank, through "
        "torch's fake process group)",
    )
    p.add_argument(
        "--compare", action="store_true", help="beside DeepSpeed's and Megatron's formulas"
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument(
        "--plan",
        default=None,
        help="a plan meshpipe plan --emit wrote: its layout's settings (a flag given that "
        "contradicts one is refused)",
    )


def config_from_args(args: argparse.Namespace, argv: Sequence[str] = ()) -> MemoryConfig:
    """The config the flags describe: the batch as --micro-batch-size (1 by default) or as
    --global-batch, or both when they agree; with --plan, the plan's layout (`argv`: the
    command line, whose flags must not contradict it)."""
    values = flag_values(MemoryConfig, args)
    if getattr(args, "plan", None):
        values = apply_plan(MemoryConfig, args.plan, values, given_fields(MemoryConfig, argv))
        args.global_batch = values["global_batch"]
    values.pop("global_batch")
    values.pop("device_memory", None)
    if str(values.get("partition", "")).strip().lower() == "memory":
        budget = args.device_memory
        values["device_memory"] = None if budget is None else str(budget)
    size, total = args.micro_batch_size, args.global_batch
    if total is None:
        return MemoryConfig.of(micro_batch_size=1 if size is None else size, **values)
    config = MemoryConfig.of(global_batch=total, **values)
    require(
        size is None or size == config.micro_batch_size,
        f"--global-batch {total} means micro-batches of {config.micro_batch_size} sequences, "
        f"not --micro-batch-size {size}: give one",
    )
    return config


def run(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """Print the estimate (and what the flags ask for); `DOES_NOT_FIT` when a rank is over
    `--device-memory`, 2 with the message on bad input."""
    try:
        output, fits = _run(args, argv)
    except ValueError as error:
        print(f"meshpipe memory: error: {error}", file=sys.stderr)
        return 2
    print(output)
    return 0 if fits else DOES_NOT_FIT


def _run(args: argparse.Namespace, argv: Sequence[str]) -> tuple[str, bool]:
    """The output, and whether the estimate fits `--device-memory` (True without one)."""
    config = config_from_args(args, argv)
    budget: int | None = args.device_memory
    choice = choose_reshard(config, budget)
    if choice is not None:
        config = with_reshard(config, choice.reshard, choice.stages)
    if args.measure:
        check_measurable(config)
    trace_ahead(trace_requests(config))  # its distinct stages traced at once
    report = estimate_memory(config)
    measured = measure_memory(config) if args.measure else None
    over = () if budget is None else report.ranks_over(budget)
    suggestions = [] if budget is None else suggest(config, report, budget)
    if args.json:
        return format_json(report, measured, budget, suggestions), not over
    parts = [format_report(report, budget)]
    if choice is not None:
        parts[0] += f"\n{choice.line}"
    if budget is not None and over:
        parts.append(format_suggestions(suggestions, budget))
    if measured is not None:
        parts.append(format_measured(report, measured))
    if config.engine.sequence_parallel:
        without = estimate_memory(replace_flat(config, sequence_parallel=False))
        parts.append(format_sequence_saving(report, without))
    if args.compare:
        parts.append(format_comparison(report))
    return "\n\n".join(parts), not over
