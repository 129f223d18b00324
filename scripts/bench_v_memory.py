"""Activation peaks of the V schedules against 1F1B, measured by the memory tracker.

Each schedule's ranks run their whole row for real on the CPU (`activation_peaks`: gradients
allocated before the tracker starts, no optimizer step), on the same model, batch and
micro-batching; 1F1B holds one stage per rank, the V schedules two. Beside each measured
ratio: the simulator's, in micro-batches of a rank's share of the model (the papers' unit),
and the formula it reproduces (Qi et al. 2024: V-Half (P + 2) // 2, V-Min (P + 4) // 3,
ZB-V P, as 1F1B). Prints a Markdown table (for docs/BENCHMARKS.md).

    python scripts/bench_v_memory.py --model-config uniform.json --pp 10 --micro-batches 10
"""

from __future__ import annotations

import argparse
import time

from engine.memory.estimate import MemoryConfig
from engine.memory.measure import activation_peaks
from engine.memory.replay import in_flight
from engine.schedule.generators import make_schedule
from engine.schedule.schedule import Schedule

_FORMULAS = {
    "1f1b": ("P", lambda p: p),
    "zb_v": ("P", lambda p: p),
    "dualpipe_v": ("–", lambda p: 0),
    "v_half": ("(P + 2) // 2", lambda p: (p + 2) // 2),
    "v_min": ("(P + 4) // 3", lambda p: (p + 4) // 3),
}


def simulated_peak(schedule: Schedule) -> float:
    """The busiest rank's in-flight peak in micro-batches of its share of the model."""
    per_rank = schedule.num_stages // schedule.num_ranks
    rows = [[a for a in row if a.is_compute] for row in schedule.rows]
    return max(in_flight(row) for row in rows) / per_rank


def _config(args: argparse.Namespace, schedule: str) -> MemoryConfig:
    per_rank = 1 if schedule == "1f1b" else 2
    model = {"model_config": args.model_config} if args.model_config else {"model": args.model}
    return MemoryConfig.of(
        micro_batch_size=args.micro_batch_size,
        pp=args.pp,
        schedule=schedule,
        stages_per_rank=per_rank,
        micro_batches=args.micro_batches,
        seq_len=args.seq_len,
        precision="fp32",
        device="cpu",
        partition="balanced",
        **model,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt-tiny")
    parser.add_argument("--model-config", default=None, help="a JSON file of the model's fields")
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--micro-batch-size", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--schedules", default="1f1b,zb_v,v_half,v_min")
    args = parser.parse_args()
    names = args.schedules.split(",")
    if names[0] != "1f1b":
        parser.error("--schedules must start with 1f1b, the baseline of every ratio")
    p, rows, base_bytes, base_sim = args.pp, [], 0, 0.0
    for name in names:
        start = time.perf_counter()
        config = _config(args, name)
        peaks = activation_peaks(config)
        per_rank = 1 if name == "1f1b" else 2
        schedule = make_schedule(
            name, num_ranks=p, micro_batches=args.micro_batches, stages_per_rank=per_rank
        )
        sim = simulated_peak(schedule)
        if name == "1f1b":
            base_bytes, base_sim = max(peaks), sim
        formula, value = _FORMULAS.get(name, ("–", lambda _: 0))
        rows.append(
            f"| {name} | {', '.join(f'{b / 2**20:.2f}' for b in peaks)} | "
            f"{max(peaks) / base_bytes:.3f} | {sim:g} ({formula} = {value(p)}) | "
            f"{sim / base_sim:.3f} | {time.perf_counter() - start:.0f} |"
        )
    size = f"{args.micro_batch_size} × {args.seq_len} tokens"
    print(f"P = {p}, m = {args.micro_batches} micro-batches of {size}, fp32")
    print(
        "| schedule | measured activation peak per rank (MiB) | busiest ÷ 1F1B's | "
        "simulated peak (µb of a rank's share) | ÷ 1F1B's | s |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
