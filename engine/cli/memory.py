"""`meshpipe memory`: its flags, and the estimate printed as they ask.

`run` prints the estimate, and on request whether it fits a device (with alternatives if
not, and exit code `DOES_NOT_FIT`), a measured run beside it, or DeepSpeed's and Megatron's
formulas beside it.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence

from engine.memory.estimate import MemoryConfig, estimate_memory
from engine.memory.measure import check_measurable, measure_memory
from engine.memory.report import (
    format_comparison,
    format_json,
    format_measured,
    format_report,
    format_suggestions,
)
from engine.memory.sizes import parse_size
from engine.memory.suggest import suggest
from engine.schedule import SCHEDULES

__all__ = ["COMMANDS", "DOES_NOT_FIT", "add_parsers", "config_from_args", "run"]

COMMANDS = ("memory",)

DOES_NOT_FIT = 3
"""Exit code when a rank's estimated peak exceeds `--device-memory`, in text and JSON mode alike,
so a script can tell without parsing (2 is bad input, as for every command; 0 otherwise)."""


def _size_arg(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _stages_arg(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"cannot read stages {text!r}: give comma-separated stage numbers such as 0,1"
        ) from None


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
    p.add_argument("--model", default="gpt-tiny", help="a registered model name")
    p.add_argument("--pp", type=int, default=1, help="pipeline ranks")
    p.add_argument("--dp", type=int, default=1, help="data-parallel replicas")
    p.add_argument("--schedule", default="1f1b", help=f"one of {', '.join(SCHEDULES)}")
    p.add_argument("--stages-per-rank", type=int, default=1, help="virtual stages per rank")
    p.add_argument("--micro-batches", type=int, default=4, help="micro-batches per step")
    p.add_argument("--micro-batch-size", type=int, default=None, help="sequences per micro-batch")
    p.add_argument(
        "--global-batch", type=int, default=None, help="sequences per step, all replicas"
    )
    p.add_argument("--seq-len", type=int, default=128, help="tokens per sequence")
    p.add_argument(
        "--dtype", "--precision", dest="precision", default="bf16", help="fp32|bf16|fp16"
    )
    p.add_argument("--partition", default="balanced", help="partition method, as meshpipe plan")
    p.add_argument("--cost-model", default="flops", help="flops|parameters|activations")
    p.add_argument("--recompute", default="none", help="none|full|every:N")
    p.add_argument("--recompute-stages", type=_stages_arg, default=None, help="only these stages")
    p.add_argument("--zero", type=int, default=0, help="1 shards AdamW's states over dp (ZeRO-1)")
    p.add_argument("--optimizer-impl", default="fused", help="AdamW: fused or per_tensor")
    p.add_argument("--device", default="cuda", help="device model: cuda or cpu")
    p.add_argument(
        "--device-memory",
        type=_size_arg,
        default=None,
        help=f"e.g. 80GB or 80GiB: say whether the layout fits (exit {DOES_NOT_FIT} if not)",
    )
    p.add_argument(
        "--measure", action="store_true", help="also run it for real here (small models)"
    )
    p.add_argument(
        "--compare", action="store_true", help="beside DeepSpeed's and Megatron's formulas"
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")


def config_from_args(args: argparse.Namespace) -> MemoryConfig:
    """The config the flags describe; `--global-batch` fixes the micro-batch size.

    dp, micro-batches and the global batch are checked before the division, so a bad one is
    named as given rather than as a divisor of 0 or a micro-batch size nobody typed.
    """
    size = args.micro_batch_size
    if args.global_batch is not None:
        for name in ("dp", "micro_batches", "global_batch"):
            value = getattr(args, name)
            if value < 1:
                raise ValueError(f"{name.replace('_', '-')}={value} must be at least 1")
        per = args.dp * args.micro_batches
        if args.global_batch % per:
            raise ValueError(
                f"global batch {args.global_batch} does not split into dp {args.dp} × "
                f"{args.micro_batches} micro-batches: use a multiple of {per}"
            )
        if size is not None and size != args.global_batch // per:
            raise ValueError(
                f"--global-batch {args.global_batch} means micro-batches of "
                f"{args.global_batch // per} sequences, not --micro-batch-size {size}: give one"
            )
        size = args.global_batch // per
    names = {f.name for f in dataclasses.fields(MemoryConfig)} - {"micro_batch_size"}
    values = {n: getattr(args, n) for n in names}
    return MemoryConfig(micro_batch_size=1 if size is None else size, **values)


def run(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """Print the estimate (and what the flags ask for); `DOES_NOT_FIT` when a rank is over
    `--device-memory`, 2 with the message on bad input."""
    try:
        output, fits = _run(args)
    except ValueError as error:
        print(f"meshpipe memory: error: {error}", file=sys.stderr)
        return 2
    print(output)
    return 0 if fits else DOES_NOT_FIT


def _run(args: argparse.Namespace) -> tuple[str, bool]:
    """The output, and whether the estimate fits `--device-memory` (True without one)."""
    config = config_from_args(args)
    if args.measure:
        check_measurable(config)
    report = estimate_memory(config)
    measured = measure_memory(config) if args.measure else None
    budget: int | None = args.device_memory
    over = () if budget is None else report.ranks_over(budget)
    suggestions = [] if budget is None else suggest(config, report, budget)
    if args.json:
        return format_json(report, measured, budget, suggestions), not over
    parts = [format_report(report, budget)]
    if budget is not None and over:
        parts.append(format_suggestions(suggestions, budget))
    if measured is not None:
        parts.append(format_measured(report, measured))
    if args.compare:
        parts.append(format_comparison(report))
    return "\n\n".join(parts), not over
