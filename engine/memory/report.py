"""`meshpipe memory`: the per-stage table, sizes as people write them, and the command itself.

`add_memory_parser` and `run_memory` plug into `engine.cli`; `run_memory` prints the estimate,
and on request whether it fits a device (with alternatives if not, and exit code
`DOES_NOT_FIT`), a measured run beside it, or DeepSpeed's and Megatron's formulas beside it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import sys
from collections.abc import Sequence

from engine.memory.estimate import MemoryConfig, MemoryReport, estimate_memory
from engine.memory.measure import check_measurable, measure_memory
from engine.memory.states import deepspeed_zero2_model_states, megatron_activations
from engine.memory.suggest import Suggestion, suggest
from engine.schedule.generators import SCHEDULES
from models import get_config, layer_specs

__all__ = [
    "DOES_NOT_FIT",
    "add_memory_parser",
    "config_from_args",
    "format_comparison",
    "format_json",
    "format_measured",
    "format_report",
    "format_size",
    "format_suggestions",
    "parse_size",
    "run_memory",
]

_UNITS = {
    "": 1,
    "b": 1,
    **{f"{p}b": 1000 ** (i + 1) for i, p in enumerate("kmgt")},
    **{f"{p}ib": 1024 ** (i + 1) for i, p in enumerate("kmgt")},
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?(?:e[+-]?\d+)?)\s*([a-z]*)\s*$", re.IGNORECASE)
_FORMS = "bytes (8e10), or a unit: 80GB = 80·10^9 bytes, 80GiB = 80·2^30 (kB … TB, KiB … TiB)"

DOES_NOT_FIT = 3
"""Exit code when a rank's estimated peak exceeds `--device-memory`, in text and JSON mode alike,
so a script can tell without parsing (2 is bad input, as for every command; 0 otherwise)."""


def parse_size(text: str) -> int:
    """Bytes from `80GB` (10^9), `80GiB` (2^30), `8e10` or `85899345920`; `80G` is ambiguous."""
    match = _SIZE.match(text)
    unit = match.group(2).lower() if match else ""
    if match and unit in ("k", "m", "g", "t"):
        raise ValueError(
            f"memory size {text!r} is ambiguous: write {match.group(1)}{unit.upper()}B "
            f"(10^n bytes) or {match.group(1)}{unit.upper()}iB (2^n bytes)"
        )
    if match is None or unit not in _UNITS:
        raise ValueError(f"cannot read memory size {text!r}: write {_FORMS}")
    value = float(match.group(1)) * _UNITS[unit]
    if not math.isfinite(value):
        raise ValueError(
            f"memory size {text!r} is beyond a float's range: give a finite size such as 80GB"
        )
    size = int(value)
    if size < 1:
        raise ValueError(f"memory size {text!r} is below one byte: give a positive size")
    return size


def format_size(nbytes: float) -> str:
    """Binary units, one decimal: `512 B`, `1.5 MiB`, `32.9 GiB`."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes:.0f} B"


def _count(n: int) -> str:
    for suffix, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f}{suffix}"
    return str(n)


def _table(rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    )


def _title(report: MemoryReport) -> str:
    c = report.config
    virtual = f" × {c.stages_per_rank} stages per rank" if c.stages_per_rank > 1 else ""
    zero = ", ZeRO-1" if c.zero else ""
    recompute = (
        c.recompute if c.recompute_stages is None else f"{c.recompute} on {c.recompute_stages}"
    )
    return (
        f"{c.model}: pp {c.pp}{virtual} × dp {c.dp}, {c.schedule}, {c.micro_batches} micro-batches "
        f"of {c.micro_batch_size} × {c.seq_len} tokens, {c.precision}, recompute {recompute}{zero}"
        f" ({c.device} model, {report.source})"
    )


def format_report(report: MemoryReport, device_memory: int | None = None) -> str:
    """The per-stage table, the rank peaks when ranks hold several stages, and the fit."""
    header = ["stage", "rank", "layers", "params", "weights", "grads", "optimizer"]
    header += ["kept/µb", "weight copies", "in flight", "step peak", "peak"]
    rows = [header]
    for s in report.stages:
        sizes = [s.weights, s.gradients, s.optimizer, s.kept_per_micro_batch]
        sizes += [s.weight_copies]
        rows.append(
            [str(s.stage), str(s.rank), f"[{s.layers[0]}, {s.layers[1]})", _count(s.parameters)]
            + [format_size(n) for n in sizes]
            + [str(s.in_flight), format_size(s.step_peak), format_size(s.peak)]
        )
    lines = [_title(report), _table(rows)]
    if report.config.stages_per_rank > 1:
        lines += [f"rank {r} peak: {format_size(p)}" for r, p in enumerate(report.rank_peaks)]
    if device_memory is not None:
        lines.append(_fit(report, device_memory))
    return "\n".join(lines)


def _fit(report: MemoryReport, device_memory: int) -> str:
    over = report.ranks_over(device_memory)
    budget = f"device memory {format_size(device_memory)} ({device_memory / 1e9:.1f} GB)"
    if not over:
        return f"fits: peak {format_size(report.peak)} of {budget}"
    worst = max(report.rank_peaks[r] - device_memory for r in over)
    return f"does not fit: ranks {list(over)} exceed {budget}, by up to {format_size(worst)}"


def format_suggestions(suggestions: Sequence[Suggestion], device_memory: int) -> str:
    """One line per alternative: its flags, its predicted peak, whether it fits."""
    if not suggestions:
        return "no single change found that fits"
    lines = ["alternatives (each re-estimated):"]
    for s in suggestions:
        fits = "fits" if s.report.peak <= device_memory else "does not fit"
        note = f"; {s.note}" if s.note else ""
        lines.append(f"  {s.change}\n      peak {format_size(s.report.peak)}, {fits}{note}")
    return "\n".join(lines)


def format_json(
    report: MemoryReport,
    measured: MemoryReport | None = None,
    device_memory: int | None = None,
    suggestions: Sequence[Suggestion] = (),
) -> str:
    """A list of reports: the estimate, then the measured run if any.

    With a device memory the estimate also carries what the text says after its table:
    `device_memory` (bytes), `fits`, `ranks_over` and the `suggestions` (each one's flags, peak
    bytes, fit and note), so a script reads the verdict rather than parsing the text.
    """
    estimate = dataclasses.asdict(report)
    if device_memory is not None:
        over = report.ranks_over(device_memory)
        estimate |= {"device_memory": device_memory, "fits": not over, "ranks_over": list(over)}
        estimate["suggestions"] = [
            {
                "change": s.change,
                "peak": s.report.peak,
                "fits": not s.report.ranks_over(device_memory),
                "note": s.note,
            }
            for s in suggestions
        ]
    extra = [] if measured is None else [dataclasses.asdict(measured)]
    return json.dumps([estimate, *extra], indent=2)


def format_measured(predicted: MemoryReport, measured: MemoryReport) -> str:
    """Predicted beside measured tracked bytes, with the allocator's own view (not modelled)."""
    rows = [
        ["stage", "kept/µb predicted", "measured", "step peak predicted", "measured", "allocator"]
    ]
    allocator = measured.allocator_peaks or (None,) * len(measured.stages)
    for p, m, a in zip(predicted.stages, measured.stages, allocator, strict=True):
        values = (p.kept_per_micro_batch, m.kept_per_micro_batch, p.step_peak, m.step_peak)
        rows.append([str(p.stage), *map(str, values), "-" if a is None else str(a)])
    same = predicted.stages == measured.stages and predicted.rank_peaks == measured.rank_peaks
    verdict = "predicted == measured (bytes)" if same else "predicted != measured"
    return f"{measured.source}, tracked bytes:\n{_table(rows)}\n{verdict}"


def format_comparison(report: MemoryReport) -> str:
    """Our stage states and stashes beside DeepSpeed's ZeRO-2 estimate and Megatron's formula."""
    c = report.config
    model, specs = get_config(c.model), layer_specs(c.model)
    rows = [
        ["stage", "states", "DeepSpeed ZeRO-2", "stash × in flight", "Megatron (flash)", "Megatron"]
    ]
    for s in report.stages:
        blocks = sum(specs[i].name == "block" for i in range(*s.layers))
        shape = {"seq_len": c.seq_len, "micro_batch_size": c.micro_batch_size}
        shape |= {"hidden": model.d_model, "heads": model.n_head, "layers": blocks}
        sizes = (
            s.weights + s.gradients + s.optimizer,
            deepspeed_zero2_model_states(s.parameters, c.dp),
            s.kept_per_micro_batch * s.in_flight,
            s.in_flight * megatron_activations(**shape, flash=True),
            s.in_flight * megatron_activations(**shape, flash=False),
        )
        rows.append([str(s.stage), *map(format_size, sizes)])
    return "reference formulas (per stage, in-flight micro-batches included):\n" + _table(rows)


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


def add_memory_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
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


def run_memory(args: argparse.Namespace) -> int:
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
