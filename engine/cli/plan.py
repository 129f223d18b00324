"""`meshpipe plan`: how a model splits into pipeline stages."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from engine.config import ModelChoice
from engine.memory.estimate import MemoryConfig, resolve
from models import LayerSpec
from partitioners import Partition, layer_costs, partition_model

__all__ = ["COMMANDS", "add_parsers", "run"]

COMMANDS = ("plan",)


def add_parsers(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register `plan` on `meshpipe`'s subparsers."""
    plan = commands.add_parser("plan", help="show how a model splits into pipeline stages")
    plan.add_argument(
        "--model", default="gpt-tiny", help="a registered model name, or hf:DIR (its shape)"
    )
    plan.add_argument("--model-config", default=None, help="a JSON file of the model's fields")
    plan.add_argument("--pp", type=int, default=2, help="number of pipeline stages")
    plan.add_argument("--partition", default="balanced", help="partition method")
    plan.add_argument(
        "--cost-model", default="flops", help="costs balanced: parameters|flops|activations|time"
    )
    plan.add_argument("--micro-batch-size", type=int, default=1, help="sequences per micro-batch")
    plan.add_argument("--seq-len", type=int, default=128, help="tokens per sequence")
    plan.add_argument(
        "--device-memory",
        default=None,
        help="memory of each device (80GB, 80GiB): the budget of --partition memory",
    )
    plan.add_argument(
        "--schedule", default="1f1b", help="the schedule --partition memory budgets for"
    )
    plan.add_argument(
        "--micro-batches", type=int, default=4, help="micro-batches --partition memory budgets for"
    )
    plan.add_argument(
        "--precision", default="bf16", help="precision --partition memory budgets for"
    )


def run(args: argparse.Namespace, argv: Sequence[str]) -> int:
    model = ModelChoice(model=args.model, model_config=args.model_config)
    specs, context = model.specs(), model.config().max_seq_len
    if args.micro_batch_size < 1 or not 1 <= args.seq_len <= context:
        raise ValueError(
            f"--micro-batch-size {args.micro_batch_size} --seq-len {args.seq_len}: give at least "
            f"1 sequence of 1 to {context} tokens ({model.name}'s context)"
        )
    kwargs = {"batch_size": args.micro_batch_size, "seq_len": args.seq_len}
    partition = _partition(args, specs)
    costs = layer_costs(specs, args.cost_model, **kwargs)
    params = [spec.num_parameters() for spec in specs]
    print(
        f"{model.name}: {len(specs)} layers on {args.pp} stages ({args.partition}, "
        f"cost share by {args.cost_model})"
    )
    print(partition.describe(costs=costs, params=params, names=[s.kind for s in specs]))
    return 0


def _partition(args: argparse.Namespace, specs: list[LayerSpec]) -> Partition:
    """The split the flags ask for; `memory` through the memory model (bf16 on a GPU, one
    micro-batch size, the schedule and micro-batches given)."""
    if args.partition.strip().lower() != "memory":
        return partition_model(
            specs,
            method=args.partition,
            num_stages=args.pp,
            cost_model=args.cost_model,
            batch_size=args.micro_batch_size,
            seq_len=args.seq_len,
        )
    config = MemoryConfig.of(
        model=args.model,
        model_config=args.model_config,
        pp=args.pp,
        schedule=args.schedule,
        micro_batches=args.micro_batches,
        micro_batch_size=args.micro_batch_size,
        seq_len=args.seq_len,
        precision=args.precision,
        partition="memory",
        device_memory=args.device_memory,
    )
    return resolve(config).partition
