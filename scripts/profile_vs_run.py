"""A pipeline run's actions against the profiles the planner prices them by, and how far one
command's step moves from run to run on this machine (issue #25, item 4; docs/BENCHMARKS.md,
session 62).

Each round runs `meshpipe train` traced (pp stages, 1F1B, one thread a rank), then prices each
stage's F + B three ways: its layers timed one at a time (`measured_forward`, what `meshpipe
plan --profile` prices), the stage built as the engine builds it and timed in this process
(`profile_stage_costs`), and the run's own means (`run_costs`). With `--spread N` the same
command then runs N times untraced: its tokens/s, their mean and standard deviation. Where
the run's actions take more than both profiles, the prices were off before the simulator
saw them; where the spread is as wide as a tolerance, no model meets that tolerance run by run.

    PYTHONPATH=$PWD python scripts/profile_vs_run.py --model gpt-bench --pp 2 --rounds 2 --spread 8
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.plan import measured_forward, profile_stage_costs
from engine.plan.run_costs import run_costs
from models import layer_specs
from partitioners import Partition, partition_model
from scripts.train_output import tokens_per_s


@dataclass(frozen=True)
class StagePrices:
    """One stage's F + B in seconds: its layers timed alone, the stage timed in-process, and
    the traced run's own mean."""

    stage: int
    layers: float
    in_process: float
    run: float


def _command(args: argparse.Namespace, bounds: Sequence[int]) -> list[str]:
    """The `meshpipe train` run every price is compared with."""
    split = ",".join(str(b) for b in bounds)
    return [
        *(sys.executable, "-m", "engine.cli", "train", "--model", args.model),
        *("--pp", str(args.pp), "--schedule", "1f1b", "--partition", f"boundaries:{split}"),
        *("--micro-batches", str(args.micro_batches), "--seq-len", str(args.seq_len)),
        *("--global-batch", str(args.micro_batches * args.micro_batch_size)),
        *("--threads", "1", "--steps", str(args.steps), "--no-progress", "--device", "cpu"),
    ]


def _bounds(args: argparse.Namespace) -> tuple[int, ...]:
    """The split `meshpipe train` makes by default: balanced by FLOPs."""
    specs = layer_specs(args.model)
    return partition_model(
        specs, method="balanced", num_stages=args.pp, seq_len=args.seq_len
    ).boundaries


def stage_prices(args: argparse.Namespace, folder: Path) -> list[StagePrices]:
    """One round: the run traced, then both profiles of its stages, beside it in time."""
    specs, bounds = layer_specs(args.model), _bounds(args)
    trace = folder / "trace.json"
    tokens_per_s([*_command(args, bounds), "--trace", str(trace)])
    own, _ = run_costs(trace, list(range(args.pp)))
    forward = measured_forward(specs, args.micro_batch_size, args.seq_len, repeats=args.repeats)
    stages = profile_stage_costs(
        specs,
        Partition(boundaries=bounds),
        batch_size=args.micro_batch_size,
        seq_len=args.seq_len,
        repeats=args.repeats,
    ).per_stage
    return [
        StagePrices(
            stage=s,
            layers=3 * sum(forward[i] for i in range(bounds[s], bounds[s + 1])),
            in_process=stages[s][0] + stages[s][1],
            run=own[s].forward + own[s].backward,
        )
        for s in range(args.pp)
    ]


def spread(args: argparse.Namespace) -> list[float]:
    """Tokens/s of the same untraced command, `args.spread` times in a row."""
    command = _command(args, _bounds(args))
    return [tokens_per_s(command) for _ in range(args.spread)]


def _print_prices(round_: int, rows: Sequence[StagePrices]) -> None:
    for p in rows:
        print(
            f"| {round_} | {p.stage} | {1e3 * p.layers:.1f} ms | {1e3 * p.in_process:.1f} ms | "
            f"{1e3 * p.run:.1f} ms | {p.run / p.layers:.3f} | {p.run / p.in_process:.3f} |"
        )


def _print_spread(tokens: Sequence[float]) -> None:
    mean = statistics.fmean(tokens)
    deviation = statistics.pstdev(tokens) / mean if len(tokens) > 1 else 0.0
    print("\n" + ", ".join(f"{t:,.0f}" for t in tokens) + " tokens/s")
    print(
        f"mean {mean:,.0f}, standard deviation {100 * deviation:.1f} %, the slowest "
        f"{100 * (1 - min(tokens) / max(tokens)):.0f} % under the fastest"
    )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gpt-bench")
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=8, help="per run; the first is left out")
    parser.add_argument("--repeats", type=int, default=15, help="timings per profiled layer")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--spread", type=int, default=0, help="untraced runs after the rounds")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)  # as each rank trains (--threads 1)
    print(
        "| round | stage | layers alone F + B | stage in-process F + B | the run's F + B "
        "| run / layers | run / stage |"
    )
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    with tempfile.TemporaryDirectory() as folder:
        for round_ in range(1, args.rounds + 1):
            _print_prices(round_, stage_prices(args, Path(folder)))
    if args.spread:
        _print_spread(spread(args))


if __name__ == "__main__":
    main()
