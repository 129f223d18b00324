"""Benchmark pipeline schedules side by side: step time, tokens/s, measured bubble, memory.

Each schedule runs in its own group of local ranks (one intra-op thread per rank), on the same
model, data and micro-batching, one after the other in one invocation; the simulator's bubble
for the same schedule with costs profiled from the real stages is printed next to the measured
one. Prints a Markdown table (for docs/BENCHMARKS.md).

    python scripts/bench_schedules.py --model gpt-bench --pp 2 --micro-batches 8 --steps 12
"""

from __future__ import annotations

import argparse
import platform
import resource
import statistics
import time
from typing import Any

import torch

from engine.comm.launch import launch_local
from engine.comm.mesh import init_mesh
from engine.runtime.engine import PipelineEngine
from engine.runtime.optim import build_optimizer
from engine.runtime.reference import reference_step
from engine.schedule.generators import VIRTUAL_SCHEDULES, make_schedule
from engine.schedule.simulate import ActionCosts, simulate
from engine.schedule.v_schedules import V_SCHEDULES
from engine.training.batches import BatchLoader
from engine.training.data import default_corpus, load_tokens
from models import build_layers, layer_specs
from partitioners import partition_model


def _stages_per_rank(schedule: str, args: argparse.Namespace) -> int:
    if schedule in V_SCHEDULES:
        return 2
    return args.stages_per_rank if schedule in VIRTUAL_SCHEDULES else 1


def _worker(args: argparse.Namespace, schedule: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    mesh = init_mesh(args.pp, 1, timeout_s=600)
    specs = layer_specs(args.model)
    local_batch = args.micro_batch_size * args.micro_batches
    v = _stages_per_rank(schedule, args)
    partition = partition_model(
        specs,
        method="balanced",
        num_stages=args.pp * v,
        batch_size=args.micro_batch_size,
        seq_len=args.seq_len,
    )
    engine = PipelineEngine(
        specs,
        mesh,
        partition=partition,
        micro_batches=args.micro_batches,
        schedule=schedule,
        stages_per_rank=v,
        optimizer=lambda m: build_optimizer(m, lr=1e-3),
        timeout_s=600,
    )
    loader = BatchLoader(
        load_tokens(default_corpus().bin_path),
        seq_len=args.seq_len,
        global_batch=local_batch,
        seed=0,
    )
    walls, stats = [], []
    for step in range(args.warmup + args.steps):
        x, y = loader.batch_at(step)
        start = time.perf_counter()
        result = engine.train_step(x, y)
        walls.append(time.perf_counter() - start)
        stats.append(result)
    measured = stats[args.warmup :]
    compute = _compute_costs(measured)
    return {
        "step_s": statistics.median(walls[args.warmup :]),
        "bubble": statistics.median(s.bubble for s in measured),
        "losses": [s.loss for s in stats],
        "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "in_flight": measured[-1].in_flight_peak,
        "costs": compute,
    }


def _compute_costs(stats: list[Any]) -> dict[int, tuple[float, float, float, float]]:
    """Median F, B, I, W seconds per stage of this rank, from the runtime's action timings."""
    spans: dict[tuple[int, str], list[float]] = {}
    for step in stats:
        for t in step.timings:
            if t.action.is_compute:
                spans.setdefault((t.action.stage, t.action.kind.value), []).append(t.end - t.start)
    stages = {stage for stage, _ in spans}
    costs = {}
    for stage in stages:
        f, b, i, w = (statistics.median(spans.get((stage, k), [0.0])) for k in "FBIW")
        costs[stage] = (f, b or i + w, i or b / 2, w or b / 2)
    return costs


def _predicted_bubble(args: argparse.Namespace, schedule: str, costs: dict[int, Any]) -> float:
    per_stage = tuple(costs[s] for s in sorted(costs))
    compute_only = make_schedule(
        schedule,
        num_ranks=args.pp,
        micro_batches=args.micro_batches,
        stages_per_rank=_stages_per_rank(schedule, args),
    )
    return simulate(compute_only, ActionCosts(per_stage=per_stage)).bubble


def _single_process_step(args: argparse.Namespace) -> float:
    """Median step of the reference trainer on one thread: the work a pipeline divides."""
    torch.set_num_threads(1)
    model = build_layers(layer_specs(args.model), seed=0)
    optimizer = build_optimizer(model, lr=1e-3)
    loader = BatchLoader(
        load_tokens(default_corpus().bin_path),
        seq_len=args.seq_len,
        global_batch=args.micro_batch_size * args.micro_batches,
        seed=0,
    )
    walls = []
    for step in range(args.warmup + args.steps):
        x, y = loader.batch_at(step)
        start = time.perf_counter()
        reference_step(model, optimizer, x, y, micro_batches=args.micro_batches)
        walls.append(time.perf_counter() - start)
    return statistics.median(walls[args.warmup :])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt-bench")
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--schedules", default="gpipe,1f1b,interleaved_1f1b,zb_h1,zb_h2")
    parser.add_argument("--stages-per-rank", type=int, default=2, help="v for interleaved")
    args = parser.parse_args()
    tokens = args.micro_batch_size * args.micro_batches * args.seq_len
    print(
        f"{args.model}, PP={args.pp}, m={args.micro_batches} × {args.micro_batch_size} "
        f"sequences of {args.seq_len}, {args.steps} steps after {args.warmup} warm-up; "
        f"{platform.processor() or platform.machine()}, torch {torch.__version__}\n"
    )
    print(
        "| schedule | s/step (median) | tokens/s | bubble measured | bubble predicted "
        "| in-flight peak per stage | peak RSS per rank (MiB) |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    single = _single_process_step(args)
    print(f"| single process, 1 thread | {single:.3f} | {tokens / single:,.0f} | – | – | – | – |")
    print(
        f"| physical limit (single / {args.pp}) | {single / args.pp:.3f} | "
        f"{args.pp * tokens / single:,.0f} | 0% | – | – | – |"
    )
    for schedule in args.schedules.split(","):
        ranks = launch_local(_worker, args.pp, args, schedule)
        results = [ranks[r] for r in sorted(ranks)]
        step_s = max(r["step_s"] for r in results)
        costs = {s: c for r in results for s, c in r["costs"].items()}
        predicted = _predicted_bubble(args, schedule, costs)
        peaks = {s: p for r in results for s, p in r["in_flight"].items()}
        rss = ", ".join(f"{r['rss_mib']:.0f}" for r in results)
        print(
            f"| {schedule} | {step_s:.3f} | {tokens / step_s:,.0f} | {results[0]['bubble']:.1%} "
            f"| {predicted:.1%} | {[peaks[s] for s in sorted(peaks)]} | {rss} |"
        )


if __name__ == "__main__":
    main()
