"""`meshpipe schedule`: generate or load a schedule, simulate it, print, plot, save."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from engine.schedule.generators import SCHEDULES, make_schedule
from engine.schedule.placement import PLACEMENTS
from engine.schedule.plots import TraceSlice, chrome_trace, plot_timeline
from engine.schedule.schedule import Schedule, format_schedule
from engine.schedule.simulate import ActionCosts, simulate, steady_state_bubble
from engine.schedule.text import load_schedule, save_schedule
from engine.training.paths import PathUse, check_paths, file_in, file_out
from engine.training.preflight import writable_folder

__all__ = ["COMMANDS", "add_parsers", "parse_costs", "run"]

COMMANDS = ("schedule",)


def add_parsers(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = commands.add_parser(
        "schedule", help="generate or load a pipeline schedule, simulate, plot and save it"
    )
    parser.add_argument(
        "--schedule", default=None, help=f"one of {', '.join(SCHEDULES)} (default 1f1b)"
    )
    parser.add_argument("--load", default=None, help="a schedule file (csv or text) to check")
    parser.add_argument("--pp", type=int, default=None, help="pipeline ranks (default 4)")
    parser.add_argument(
        "--micro-batches", type=int, default=None, help="micro-batches per step (default 8)"
    )
    parser.add_argument(
        "--stages-per-rank",
        type=int,
        default=None,
        help="v (interleaved, looped; 2 for zb_v, v_half, v_min; default 1)",
    )
    parser.add_argument(
        "--placement",
        default=None,
        choices=PLACEMENTS,
        help="loop (stage s on rank s mod pp) or v (rank r: stages r and 2pp-1-r); default: "
        "the schedule's own",
    )
    parser.add_argument(
        "--costs",
        default="1,2,1,1,0",
        help=(
            "F,B,I,W[,comm] per action in abstract units (--trace reads them as milliseconds), "
            "or profile:MODEL to time the real stages in seconds"
        ),
    )
    parser.add_argument("--micro-batch-size", type=int, default=1, help="for profile: costs")
    parser.add_argument("--seq-len", type=int, default=128, help="for profile: costs")
    parser.add_argument("--plot", default=None, help="write the simulated timeline as a PNG")
    parser.add_argument(
        "--trace",
        default=None,
        help="write the simulated timeline as a Chrome trace (unit costs as ms, profile: as s)",
    )
    parser.add_argument(
        "--format",
        default=None,
        choices=("text", "csv"),
        help="for --out (default: csv for a .csv name, else text)",
    )
    parser.add_argument("--out", default=None, help="write the schedule to this file")


def parse_costs(text: str, schedule: Schedule, args: argparse.Namespace) -> ActionCosts:
    """`F,B,I,W[,comm]` numbers, or `profile:MODEL` (balanced partition, timed on this CPU).

    The partition balances FLOPs at the micro-batch size and sequence length the stages are
    timed at: attention grows with the sequence, so another shape can move the boundaries.
    """
    if text.startswith("profile:"):
        from engine.plan.profile import profile_stage_costs
        from models import layer_specs
        from partitioners import partition_model

        specs = layer_specs(text.split(":", 1)[1])
        shape = {"batch_size": args.micro_batch_size, "seq_len": args.seq_len}
        partition = partition_model(
            specs, method="balanced", num_stages=schedule.num_stages, **shape
        )
        return profile_stage_costs(specs, partition, **shape)
    try:
        values = [float(v) for v in text.split(",")]
    except ValueError:
        values = []
    if len(values) not in (4, 5):
        raise ValueError(
            f"--costs {text!r}: give F,B,I,W or F,B,I,W,comm as numbers (e.g. 1,2,1,1,0) "
            "or profile:MODEL"
        )
    f, b, i, w = values[:4]
    return ActionCosts(
        forward=f, backward=b, input_grad=i, weight_grad=w, comm=values[4] if values[4:] else 0.0
    )


def _trace_unit_s(costs_text: str) -> float:
    """Seconds per simulated time unit in `--trace`.

    `profile:` costs are measured seconds, so they go to the trace as they are; abstract unit
    costs (`1,2,1,1`) have no time unit, and reading one unit as a millisecond gives slices a
    trace viewer shows at a readable zoom.
    """
    return 1.0 if costs_text.startswith("profile:") else 1e-3


_GENERATOR_FLAGS: dict[str, Any] = {
    "schedule": "1f1b",
    "pp": 4,
    "micro_batches": 8,
    "stages_per_rank": 1,
    "placement": None,
}
"""What --schedule, --pp, --micro-batches and --stages-per-rank default to without --load."""


def _schedule(args: argparse.Namespace) -> Schedule:
    """The loaded file, or the generated schedule; a file fixes ranks and micro-batches."""
    given = [f"--{k.replace('_', '-')}" for k in _GENERATOR_FLAGS if getattr(args, k) is not None]
    if args.load:
        if given:
            raise ValueError(
                f"--load takes the schedule, ranks and micro-batches from {args.load}: drop "
                f"{', '.join(given)}"
            )
        return load_schedule(args.load)
    values: dict[str, Any] = {k: default if getattr(args, k) is None else getattr(args, k)
              for k, default in _GENERATOR_FLAGS.items()}  # fmt: skip
    return make_schedule(
        values["schedule"],
        num_ranks=values["pp"],
        micro_batches=values["micro_batches"],
        stages_per_rank=values["stages_per_rank"],
        placement=values["placement"],
    )


def _paths(args: argparse.Namespace) -> list[PathUse]:
    """What the command reads (--load) and writes (matplotlib adds .png to a --plot without a
    suffix)."""
    plot = Path(args.plot) if args.plot else None
    written = {"plot": plot if plot is None or plot.suffix else plot.with_suffix(".png")}
    uses = [file_in("--load", args.load)] if args.load else []
    for flag in ("plot", "trace", "out"):
        if getattr(args, flag):
            uses.append(file_out(f"--{flag}", getattr(args, flag), written.get(flag)))
    return uses


def run(args: argparse.Namespace, argv: Sequence[str]) -> int:
    check_paths(_paths(args))
    for flag in ("plot", "trace", "out"):  # before the report, not after it
        path = getattr(args, flag)
        if path:
            writable_folder(Path(path).parent, f"--{flag}", path)
    schedule = _schedule(args)
    costs = parse_costs(args.costs, schedule, args)
    result = simulate(schedule, costs)
    print(format_schedule(schedule))
    print(
        f"\n{schedule.name}: P={schedule.num_ranks}, stages={schedule.num_stages}, "
        f"m={schedule.micro_batches}; step {result.step_time:.4g}, bubble {result.bubble:.1%}"
    )
    if not schedule.lowered:
        steady = steady_state_bubble(schedule, costs)
        print(f"steady-state idle per rank and step (no barrier): {steady:.4g}")
    print(f"in-flight peak per stage:   {list(result.in_flight_peak)}")
    print(f"pending-W peak per stage:   {list(result.pending_w_peak)}")
    print(f"activation peak per stage:  {list(result.activation_peak)}")
    title = f"{schedule.name} P={schedule.num_ranks} m={schedule.micro_batches}"
    if args.plot:
        plot_timeline(result, args.plot, title=title)
        print(f"wrote {args.plot}")
    if args.trace:
        slices = [
            [TraceSlice(str(t.action), t.start, t.end) for t in row] for row in result.timeline
        ]
        chrome_trace(slices, args.trace, unit_s=_trace_unit_s(args.costs), process=title)
        print(f"wrote {args.trace}")
    if args.out:
        fmt = args.format or ("csv" if Path(args.out).suffix.lower() == ".csv" else "text")
        save_schedule(schedule, args.out, fmt=fmt)
        print(f"wrote {args.out} ({fmt})")
    return 0
