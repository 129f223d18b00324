"""`meshpipe plan`: how a model splits into pipeline stages."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from models import get_config, layer_specs
from partitioners import layer_costs, partition_model

__all__ = ["COMMANDS", "add_parsers", "run"]

COMMANDS = ("plan",)


def add_parsers(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register `plan` on `meshpipe`'s subparsers."""
    plan = commands.add_parser("plan", help="show how a model splits into pipeline stages")
    plan.add_argument("--model", default="gpt-tiny", help="a registered model name")
    plan.add_argument("--pp", type=int, default=2, help="number of pipeline stages")
    plan.add_argument("--partition", default="balanced", help="partition method")
    plan.add_argument(
        "--cost-model", default="flops", help="costs balanced: parameters|flops|activations|time"
    )
    plan.add_argument("--micro-batch-size", type=int, default=1, help="sequences per micro-batch")
    plan.add_argument("--seq-len", type=int, default=128, help="tokens per sequence")


def run(args: argparse.Namespace, argv: Sequence[str]) -> int:
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
