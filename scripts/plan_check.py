"""The planner's cost model against measured step times on this machine (issue #25, item 4).

Each layer is timed here (`meshpipe plan --profile`'s costs); each layout is predicted by the
planner (`engine.plan.predict`), written as a plan file and run by `meshpipe train --plan` for
a few steps (the first, warm-up step left out of its tokens/s); the table prints predicted and
measured seconds per step and the error. Then the planner's own choice for the same devices
against the hand choice (balanced split, 1F1B, no recompute, the largest micro-batch that fits).

    PYTHONPATH=$PWD python scripts/plan_check.py --model gpt-bench --devices 2
    PYTHONPATH=$PWD python scripts/plan_check.py --model gpt-bench --devices 4 --zero-levels

With `--own-costs` each run is traced, and its schedule simulated again with the run's own
mean action times (`engine.plan.run_costs`): where that lands near the measured step and the
prediction does not, the prices were off, not the simulator's structure.

A GPU run: add `--device cuda --device-memory 80GB` on a machine with the GPUs: the layers
and the optimizer phase are then timed on the GPU (waiting for its kernels), I's share of a
backward is taken by FLOPs, and more than one device needs `--link-bandwidth` and
`--latency` (scripts/gpu_checks.sh, part `plan`, runs `--devices 1`).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch

from engine.config import ParallelConfig, parse_size
from engine.plan import (
    Hardware,
    Link,
    PlanRequest,
    available_cores,
    measured_forward,
    measured_input_shares,
    measured_link,
    measured_memory_bandwidth,
    measured_split_forward,
    search,
    step_with_costs,
    write_plan,
)
from engine.plan.candidates import Candidate, meshes
from engine.plan.request import Prediction
from engine.plan.run_costs import run_costs
from engine.plan.search import predict
from engine.schedule import own_placement
from models import layer_specs
from scripts.train_output import tokens_per_s


def _layouts(devices: int, global_batch: int) -> list[Candidate]:
    """Layouts of `devices` ranks (1, 2 or 4): pp, dp and tp of 1, 2 or 4, several schedules
    and recompute, micro-batches of 2 sequences."""

    def c(
        pp: int, dp: int, tp: int, schedule: str = "1f1b", recompute: tuple[int, ...] = ()
    ) -> Candidate:
        return Candidate(
            mesh=ParallelConfig(pp=pp, dp=dp, tp=tp),
            schedule=schedule,
            stages_per_rank=1,
            micro_batches=global_batch // (2 * dp),
            micro_batch_size=2,
            recompute=recompute,
        )

    if devices == 1:
        return [c(1, 1, 1), c(1, 1, 1, recompute=(0,))]
    if devices == 4:  # on a host of two cores, its ranks share them (`Hardware.host_cores`)
        return [
            c(4, 1, 1),
            c(4, 1, 1, "gpipe"),
            c(4, 1, 1, "zb_h1"),
            c(4, 1, 1, recompute=(0, 1, 2, 3)),
            c(2, 2, 1),
            c(2, 1, 2),
            c(1, 4, 1),
        ]
    return [
        c(2, 1, 1),
        c(2, 1, 1, "gpipe"),
        c(2, 1, 1, "zb_h1"),
        c(2, 1, 1, "zb_h1", recompute=(0, 1)),
        c(2, 1, 1, recompute=(0, 1)),
        c(2, 1, 1, recompute=(0,)),
        c(1, 2, 1),
        c(1, 1, 2),
    ]


_ZERO_MODES = ((0, "step"), (1, "step"), (2, "step"), (3, "step"), (3, "micro-batch"))
"""(ZeRO level, reshard) of each row of `--zero-levels`."""


def _zero_layouts(global_batch: int) -> list[Candidate]:
    """Issue #21's throughput check: pp 2 × dp 2, 1F1B, at every ZeRO level (and ZeRO-3
    resharded per micro-batch), micro-batches of 2 sequences."""
    return [
        Candidate(
            mesh=ParallelConfig(pp=2, dp=2, tp=1),
            schedule="1f1b",
            stages_per_rank=1,
            micro_batches=global_batch // 4,
            micro_batch_size=2,
            zero=zero,
            zero_reshard=reshard,
        )
        for zero, reshard in _ZERO_MODES
    ]


_SIZES = (1, 2, 4, 8)
"""Micro-batch sizes the planner may choose."""

_REPEATS = 15
"""Runs each layer is timed over (the median): this VM's single runs vary by ±15 %."""


def _measure(
    request: PlanRequest, plan: Prediction, steps: int, folder: Path, trace: Path | None = None
) -> float:
    """Seconds per step of `meshpipe train --plan` (steady steps); with `trace`, traced there."""
    path = folder / "plan.json"
    write_plan(path, request, plan)
    ranks = plan.candidate.mesh.pp * plan.candidate.mesh.dp * plan.candidate.mesh.tp
    command = [sys.executable, "-m", "engine.cli", "train", "--plan", str(path)]
    command += ["--steps", str(steps), "--no-progress", "--device", request.device]
    command += ["--trace", str(trace)] if trace is not None else []
    if request.device == "cpu":
        command += ["--threads", "1"]  # as the layers were timed
    assert ranks == request.devices
    return request.global_batch * request.seq_len / tokens_per_s(command)


def _hand_choice(request: PlanRequest) -> Prediction:
    """Every device a pipeline stage, balanced, 1F1B, no recompute, the largest micro-batch
    that fits."""
    for mbs in sorted(request.micro_batch_sizes, reverse=True):
        m = request.global_batch // mbs
        if request.global_batch % mbs or m < 1:
            continue
        layout = Candidate(
            mesh=ParallelConfig(pp=request.devices, dp=1, tp=1),
            schedule="1f1b",
            stages_per_rank=1,
            micro_batches=m,
            micro_batch_size=mbs,
        )
        plan = predict(request, layout)
        if max(plan.rank_peaks) <= request.device_memory:
            return plan
    raise ValueError("no micro-batch size fits the hand choice")


def _request(
    args: argparse.Namespace, sizes: tuple[int, ...], widths: Sequence[int]
) -> PlanRequest:
    """A request with the layers and the link measured now: this VM's speed drifts by up to
    25 % within minutes, so each layout is predicted from costs taken just before its run."""
    specs, cpu = layer_specs(args.model), args.device == "cpu"
    # gloo between this host's processes; a GPU run's link is the flags' (`main` asks for them)
    measure = cpu and args.devices > 1
    link = measured_link(args.devices) if measure else Link(latency=0.0, bandwidth=1e12)
    latency = link.latency if args.latency is None else args.latency
    bandwidth = link.bandwidth if args.link_bandwidth is None else args.link_bandwidth
    return PlanRequest(
        model=args.model,
        devices=args.devices,
        device_memory=parse_size(args.device_memory),
        global_batch=args.global_batch,
        seq_len=args.seq_len,
        precision="fp32",
        device=args.device,
        hardware=Hardware(
            link_bandwidth=bandwidth,
            latency=latency,
            gpus_per_node=8,
            reduce_scatter_factor=link.reduce_scatter_factor,
            all_gather_factor=link.all_gather_factor,
            host_cores=available_cores() if cpu else 0,
            memory_bandwidth=measured_memory_bandwidth(specs, device=args.device),
        ),
        measured={
            b: measured_forward(specs, b, args.seq_len, _REPEATS, device=args.device) for b in sizes
        },
        measured_split={
            (b, tp): measured_split_forward(specs, b, args.seq_len, tp, _REPEATS)
            for b in sizes
            for tp in widths
            if tp > 1
        },
        # on a GPU, I's share of each backward by FLOPs: the stage profile runs on the CPU
        measured_input_shares=(
            {b: measured_input_shares(specs, b, args.seq_len) for b in sizes} if cpu else None
        ),
        micro_batch_sizes=sizes,
    )


def _row(
    name: str, request: PlanRequest, plan: Prediction, args: argparse.Namespace, folder: Path
) -> tuple[float, float]:
    """Print and return (predicted, measured) seconds per step; with `--own-costs`, also the
    step simulated with the run's own action times (`run_costs`) and its error."""
    trace = folder / "trace.json" if args.own_costs else None
    measured = _measure(request, plan, args.steps, folder, trace)
    error = plan.step_time / measured - 1
    link = (
        f"{request.hardware.latency * 1e3:.2f} ms, {request.hardware.link_bandwidth / 1e9:.2f} GB/s"
    )
    own = ""
    if trace is not None:
        placement = own_placement(plan.candidate.schedule, plan.candidate.mesh.pp,
                                  plan.candidate.stages_per_rank)  # fmt: skip
        replayed = step_with_costs(request, plan, *run_costs(trace, placement))
        own = f"   own actions {replayed:.4f}s {replayed / measured - 1:+.1%}"
    print(
        f"{name:<44} {plan.step_time:>9.4f}s {measured:>9.4f}s {error:>+7.1%}   {link}{own}",
        flush=True,
    )
    return plan.step_time, measured


def _zero_levels(args: argparse.Namespace, folder: Path) -> None:
    """Every ZeRO level at pp 2 × dp 2, predicted and measured, then each against ZeRO-1."""
    layouts = {c.describe(): c for c in _zero_layouts(args.global_batch)}
    rows: dict[str, list[tuple[float, float]]] = {name: [] for name in layouts}
    for _ in range(args.rounds):
        _round(args, layouts, rows, folder)
    medians = _medians(rows)
    base = next(times for name, times in medians.items() if name.endswith("zero1"))
    print(f"\n{'layout':<44} {'predicted/ZeRO-1':>17} {'measured/ZeRO-1':>16}")
    for name, (predicted, measured) in medians.items():
        print(f"{name:<44} {predicted / base[0]:>16.2f}x {measured / base[1]:>15.2f}x")


def _round(
    args: argparse.Namespace,
    layouts: dict[str, Candidate],
    rows: dict[str, list[tuple[float, float]]],
    folder: Path,
) -> None:
    """Each layout once: its layers and the link timed, predicted, run; its row appended."""
    for name, c in layouts.items():
        request = _request(args, (c.micro_batch_size,), (c.mesh.tp,))
        rows[name].append(_row(name, request, predict(request, c), args, folder))


def _medians(rows: dict[str, list[tuple[float, float]]]) -> dict[str, tuple[float, float]]:
    """Each layout's median prediction and median measurement over the rounds."""
    return {
        name: (statistics.median(p for p, _ in runs), statistics.median(m for _, m in runs))
        for name, runs in rows.items()
    }


def _layout_rounds(args: argparse.Namespace, folder: Path) -> None:
    """Every layout, then the planner's choice and the hand choice (chosen in the first round
    and kept), each round timing the layers and the link again before each run; with more than
    one round, each layout's median prediction against its median measurement."""
    layouts = {c.describe(): c for c in _layouts(args.devices, args.global_batch)}
    rows: dict[str, list[tuple[float, float]]] = {name: [] for name in layouts}
    for round_ in range(args.rounds):
        _round(args, layouts, rows, folder)
        if round_ == 0:
            for name, (request, plan) in _choices(args).items():
                layouts[name] = plan.candidate
                rows[name] = [_row(name, request, plan, args, folder)]
    if args.rounds > 1:
        print(f"\nmedians over {args.rounds} rounds")
        print(f"{'layout':<44} {'predicted':>10} {'measured':>10} {'error':>7}   every round")
        for name, (predicted, measured) in _medians(rows).items():
            each = ", ".join(f"{p / m - 1:+.1%}" for p, m in rows[name])
            print(f"{name:<44} {predicted:>9.4f}s {measured:>9.4f}s "
                  f"{predicted / measured - 1:>+7.1%}   {each}")  # fmt: skip


def _choices(args: argparse.Namespace) -> dict[str, tuple[PlanRequest, Prediction]]:
    """The planner's choice for the devices, and the hand choice, each with its request."""
    widths = sorted({m.tp for m in meshes(args.model, args.devices,
                                          num_layers=len(layer_specs(args.model)),
                                          seq_len=args.seq_len, gpus_per_node=8)})  # fmt: skip
    request = _request(args, _SIZES, widths)
    chosen = search(request).plans[0]
    hand_request = _request(args, _SIZES, ())
    hand = _hand_choice(hand_request)
    return {
        "planner: " + chosen.candidate.describe(): (request, chosen),
        "hand: " + hand.candidate.describe(): (hand_request, hand),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt-bench")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--device-memory", default="4GB")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--link-bandwidth", type=float, help="bytes/s (measured: gloo here)")
    parser.add_argument("--latency", type=float, help="seconds (measured: gloo here)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--zero-levels", action="store_true", help="pp 2 × dp 2 at every ZeRO level (4 devices)"
    )
    parser.add_argument(
        "--own-costs", action="store_true",
        help="trace each run and simulate it again with its own action times: the model's "
        "structure apart from its prices",
    )  # fmt: skip
    parser.add_argument(
        "--rounds", type=int, default=1,
        help="run every layout this many times, round-robin; report each one's medians",
    )  # fmt: skip
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: give 1 or more")
    if args.device != "cpu" and args.devices > 1 and None in (args.link_bandwidth, args.latency):
        parser.error(
            f"--device {args.device} --devices {args.devices}: the link measured here is gloo's "
            "between this host's processes, not the GPUs'; give --link-bandwidth and --latency"
        )
    torch.set_num_threads(1)  # each rank trains on one thread (--threads 1)
    print(f"{'layout':<44} {'predicted':>10} {'measured':>10} {'error':>7}   link (measured)")
    if args.zero_levels:
        if args.devices != 4:
            parser.error("--zero-levels runs pp 2 × dp 2: give --devices 4")
        with tempfile.TemporaryDirectory() as folder:
            _zero_levels(args, Path(folder))
        return
    with tempfile.TemporaryDirectory() as folder:
        _layout_rounds(args, Path(folder))


if __name__ == "__main__":
    main()
