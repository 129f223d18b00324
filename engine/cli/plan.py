"""`meshpipe plan`: how a model splits into given pipeline stages, or, with `--devices`, the
whole layout chosen for the user (`engine.plan.search`), printed, emitted and plotted."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import cast

from engine.cli.flags import add_config_flags, flag_values, given_fields
from engine.cli.plan_report import Traced, format_result
from engine.config import ModelChoice, format_size, parse_size, require
from engine.memory.estimate import MemoryConfig, resolve
from engine.memory.trace_cache import writes
from engine.plan import (
    ACCELERATORS,
    DOUBLINGS,
    Hardware,
    PlanRequest,
    PlanResult,
    Progress,
    accelerator,
    available_cores,
    fewest_devices,
    measured_device_flops,
    measured_forward,
    measured_input_shares,
    measured_link,
    measured_memory_bandwidth,
    measured_split_forward,
    plot_plan,
    search,
    write_plan,
)
from engine.plan.candidates import meshes
from models import LayerSpec, layer_specs
from partitioners import Partition, layer_costs, partition_model

__all__ = ["COMMANDS", "add_parsers", "run"]

COMMANDS = ("plan",)

_SPLIT_ONLY = ("--pp", "--partition", "--cost-model", "--schedule", "--micro-batches")
"""Flags of a given split, which the planner chooses itself."""
_PLANNER_ONLY = ("--global-batch", "--emit", "--plot", "--profile", "--top", "--accelerator")


def add_parsers(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register `plan` on `meshpipe`'s subparsers."""
    plan = commands.add_parser(
        "plan",
        help="choose a layout (--devices) or show how a model splits into pipeline stages",
    )
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
        help="memory of each device (80GB, 80GiB): the planner's budget, or that of "
        "--partition memory",
    )
    plan.add_argument(
        "--schedule", default="1f1b", help="the schedule --partition memory budgets for"
    )
    plan.add_argument(
        "--micro-batches", type=int, default=4, help="micro-batches --partition memory budgets for"
    )
    plan.add_argument("--precision", default="bf16", help="precision of the run planned for")
    _add_planner_flags(plan)


def _add_planner_flags(plan: argparse.ArgumentParser) -> None:
    planner = plan.add_argument_group("planner (with --devices)")
    planner.add_argument(
        "--devices", type=int, default=None, help="search every layout of this many devices"
    )
    planner.add_argument("--global-batch", type=int, default=None, help="sequences per step")
    planner.add_argument(
        "--accelerator",
        default=None,
        help=f"the devices' datasheet rates ({', '.join(ACCELERATORS)}): their dense bf16 "
        "FLOP/s and memory bandwidth; --device-flops and --memory-bandwidth, given, win",
    )
    add_config_flags(cast(argparse.ArgumentParser, planner), Hardware)
    planner.add_argument(
        "--profile",
        action="store_true",
        help="time each layer on this CPU instead of FLOPs at --device-flops (memory as the "
        "CPU holds it)",
    )
    planner.add_argument(
        "--micro-batch-sizes", default="1,2,4,8", help="micro-batch sizes to try, e.g. 1,2,4"
    )
    planner.add_argument("--top", type=int, default=3, help="plans to print")
    planner.add_argument("--emit", default=None, help="write the best plan here (JSON)")
    planner.add_argument("--plot", default=None, help="draw the best plan here (PNG)")


def run(args: argparse.Namespace, argv: Sequence[str]) -> int:
    if args.devices is not None:
        return _plan(args, argv)
    given = [flag for flag in _PLANNER_ONLY if _given(flag, argv)]
    require(not given, f"{', '.join(given)}: the planner's, which runs with --devices N")
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


def _given(flag: str, argv: Sequence[str]) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in argv)


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


def request_from_args(args: argparse.Namespace, argv: Sequence[str]) -> PlanRequest:
    """The planner's request; a flag of a given split is refused (the planner chooses it)."""
    given = [flag for flag in (*_SPLIT_ONLY, "--micro-batch-size") if _given(flag, argv)]
    require(
        not given,
        f"{', '.join(given)} with --devices: the planner chooses the layout; drop them "
        "(or drop --devices to see a given split)",
    )
    require(args.global_batch is not None, "--devices plans a run: give --global-batch B")
    require(
        args.device_memory is not None, "--devices plans a run: " + _memory_hint(args.accelerator)
    )
    sizes = _sizes(args.micro_batch_sizes)
    hardware = _hardware(args, argv)
    model = args.model_config or args.model  # a registered name, hf:DIR or a .json of fields
    measured, split, shares = (
        _profile(args, model, sizes, hardware) if args.profile else (None, None, None)
    )
    return PlanRequest(
        model=model,
        devices=args.devices,
        device_memory=parse_size(str(args.device_memory)),
        global_batch=args.global_batch,
        seq_len=args.seq_len,
        precision=args.precision,
        device="cpu" if args.profile else "cuda",
        hardware=hardware,
        measured=measured,
        measured_split=split,
        measured_input_shares=shares,
        micro_batch_sizes=sizes,
        top=args.top,
    )


def _hardware(args: argparse.Namespace, argv: Sequence[str]) -> Hardware:
    """The devices' rates: the flags given, over the named accelerator's (--accelerator), over
    the defaults (an H100 SXM's); with --profile, the memory bandwidth (the model's optimizer
    phase), the GEMM peak (what MFU is reported against), the links, and the cores this
    host's ranks would share, measured here unless given."""
    require(
        not (args.profile and args.accelerator is not None),
        f"--accelerator {args.accelerator} with --profile: the profile times the layers on this "
        "machine's CPU, so the accelerator's rates would not be used; give one of them",
    )
    rates = flag_values(Hardware, args)
    given = given_fields(Hardware, argv)
    if args.accelerator is not None:
        chip = accelerator(args.accelerator)
        named = {"device_flops": chip.device_flops, "memory_bandwidth": chip.memory_bandwidth}
        rates |= {name: value for name, value in named.items() if name not in given}
    hardware = Hardware(**rates)
    if args.profile and "memory_bandwidth" not in given:
        specs = layer_specs(args.model_config or args.model)
        hardware = replace(hardware, memory_bandwidth=measured_memory_bandwidth(specs))
    if args.profile and "device_flops" not in given:
        hardware = replace(hardware, device_flops=measured_device_flops(args.precision))
    if args.profile:
        hardware = _profiled_links(hardware, given)
    if args.profile and "host_cores" not in given:
        hardware = replace(hardware, host_cores=available_cores())
    return hardware


_LINK_FIELDS = (
    "link_bandwidth",
    "inter_node_bandwidth",
    "latency",
    "reduce_scatter_factor",
    "all_gather_factor",
)


def _profiled_links(hardware: Hardware, given: set[str]) -> Hardware:
    """With --profile the layers are timed on this host, so its ranks would talk over gloo
    between its processes, not over the defaults' NVLink: the links are measured here
    (`measured_link`, two processes), except the flags given."""
    if all(name in given for name in _LINK_FIELDS):
        return hardware
    link = measured_link()
    measured = {
        "link_bandwidth": link.bandwidth,
        "inter_node_bandwidth": link.bandwidth,
        "latency": link.latency,
        "reduce_scatter_factor": link.reduce_scatter_factor,
        "all_gather_factor": link.all_gather_factor,
    }
    kept = {name: value for name, value in measured.items() if name not in given}
    return replace(hardware, **kept)  # type: ignore[arg-type]


def _memory_hint(name: str | None) -> str:
    """What to give as --device-memory: the budget a rank may use, which is less than what
    the device holds (the CUDA context, communication buffers, the allocator's cache)."""
    if name is None:
        return "give --device-memory (80GB)"
    held = accelerator(name).memory_gb
    return (
        f"give --device-memory: an {name} holds {held} GB by its datasheet; give what a rank "
        "may use of it (less: the CUDA context and communication buffers take some)"
    )


def _profile(
    args: argparse.Namespace, model: str, sizes: tuple[int, ...], hardware: Hardware
) -> tuple[
    dict[int, tuple[float, ...]],
    dict[tuple[int, int], tuple[float, ...]],
    dict[int, tuple[float, ...]],
]:
    """`--profile`: each layer timed here per micro-batch size, split as the engine splits it
    for every tp width the search will weigh (`measured_split_forward`), and its backward's
    I and W timed apart (`measured_input_shares`)."""
    specs = layer_specs(model)
    measured = {b: measured_forward(specs, b, args.seq_len) for b in sizes}
    shares = {b: measured_input_shares(specs, b, args.seq_len) for b in sizes}
    layouts = meshes(
        model,
        args.devices,
        num_layers=len(specs),
        seq_len=args.seq_len,
        gpus_per_node=hardware.gpus_per_node,
    )
    widths = sorted({mesh.tp for mesh in layouts} - {1})
    split = {
        (b, tp): measured_split_forward(specs, b, args.seq_len, tp) for b in sizes for tp in widths
    }
    return measured, split, shares


def _sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(part) for part in text.split(","))
    except ValueError:
        sizes = ()
    require(
        bool(sizes) and min(sizes) >= 1,
        f"--micro-batch-sizes {text!r}: give comma-separated sizes of at least 1, such as 1,2,4",
    )
    return sizes


def _plan(args: argparse.Namespace, argv: Sequence[str]) -> int:
    request = request_from_args(args, argv)
    start = time.perf_counter()
    traced: Traced = {}
    before = writes("trace")
    result = search(request, progress=_progress(start, traced), timeline=bool(args.plot))
    elapsed = time.perf_counter() - start
    _check_found(result, start)
    print(format_result(result, elapsed, traced, writes("trace").since(before)))
    best = result.plans[0]
    if args.emit:
        write_plan(args.emit, request, best)
        print(f"wrote {args.emit}: meshpipe train --plan {args.emit} runs plan 1")
    if args.plot:
        plot_plan(request, best, args.plot)
        print(f"wrote {args.plot}")
    return 0


def _progress(start: float, traced: Traced | None = None) -> Progress:
    """Report the search's traces and simulations on stderr once it has taken more than a
    second; tally in `traced` what it traced and how long that took."""
    began: dict[str, float] = {}

    def report(what: str, done: int, total: int) -> None:
        now = time.perf_counter()
        if traced is not None and what.startswith("tracing "):
            _tally(traced, began, what.removeprefix("tracing "), done, total, now)
        if now - start > 1 and sys.stderr.isatty():
            end = "\n" if done == total else ""
            print(f"\rmeshpipe plan: {what} {done}/{total}", end=end, file=sys.stderr)

    return report


def _tally(
    traced: Traced, began: dict[str, float], kind: str, done: int, total: int, now: float
) -> None:
    """One round of `trace_ahead` (its first report, done 0, comes before its first trace)
    added to `traced` once its last trace is in."""
    if done == 0:
        began[kind] = now
    elif done == total and kind in began:
        count, seconds = traced.get(kind, (0, 0.0))
        traced[kind] = (count + total, seconds + now - began.pop(kind))


def _check_found(result: PlanResult, start: float) -> None:
    r = result.request
    require(
        result.considered > 0,
        f"--global-batch {r.global_batch} splits over no layout of {r.devices} devices "
        f"(the replicas must divide it, into micro-batches of {r.micro_batch_sizes}): give a "
        f"multiple of {r.devices} or other --micro-batch-sizes",
    )
    if result.plans:
        return
    least, fewest = result.least_memory, fewest_devices(r, _progress(start))
    devices = (
        f"--devices {fewest} (the fewest, doubling, that the memory screen fits)"
        if fewest
        else f"more --devices (none up to {r.devices * 2**DOUBLINGS} fits the memory screen)"
    )
    raise ValueError(
        f"no layout of {r.model} fits {r.devices} devices of {format_size(r.device_memory)} "
        f"at global batch {r.global_batch} × {r.seq_len} tokens: the leanest needs "
        f"{format_size(least or 0)} per device; give a --device-memory that large, {devices}, "
        "or a shorter --seq-len"
    )
