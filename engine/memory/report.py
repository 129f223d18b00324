"""The per-stage memory table and its companions: the fit against a device, the alternatives,
a measured run beside the estimate, DeepSpeed's and Megatron's formulas beside it, and JSON.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence

from engine.config.sizes import format_size
from engine.memory.estimate import MemoryReport
from engine.memory.reshard import stages_text
from engine.memory.states import deepspeed_zero2_model_states, megatron_activations
from engine.memory.suggest import Suggestion

__all__ = [
    "format_comparison",
    "format_json",
    "format_measured",
    "format_report",
    "format_sequence_saving",
    "format_suggestions",
]


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
    v, engine = c.schedule.stages_per_rank, c.engine
    virtual = f" × {v} stages per rank" if v > 1 else ""
    zero = f", ZeRO-{engine.zero}" if engine.zero else ""
    zero += " resharded per micro-batch" if engine.zero_reshard == "micro-batch" else ""
    if engine.zero_reshard_stages is not None:
        zero += f" on {stages_text(engine.zero_reshard_stages)}"
    tp = f" × tp {c.parallel.tp}" if c.parallel.tp > 1 else ""
    tp += " (sequence parallel)" if engine.sequence_parallel else ""
    recompute = engine.recompute
    if engine.recompute_stages is not None:
        recompute = f"{engine.recompute} on {engine.recompute_stages}"
    return (
        f"{c.model.name}: pp {c.parallel.pp}{virtual} × dp {c.parallel.dp}{tp}, "
        f"{c.schedule.schedule}, {c.schedule.micro_batches} micro-batches of "
        f"{c.micro_batch_size} × {c.batch.seq_len} tokens, {engine.precision}, "
        f"recompute {recompute}{zero} ({c.device} model, {report.source})"
    )


def format_report(report: MemoryReport, device_memory: int | None = None) -> str:
    """The per-stage table, the rank peaks when ranks hold several stages, and the fit."""
    header = ["stage", "rank", "layers", "params", "weights", "grads", "optimizer"]
    copies = any(s.replica_copies for s in report.stages)
    header += ["dp-sync copies"] * copies
    header += ["kept/µb", "weight copies", "in flight", "step peak", "peak"]
    rows = [header]
    for s in report.stages:
        sizes = [s.weights, s.gradients, s.optimizer, *[s.replica_copies] * copies]
        sizes += [s.kept_per_micro_batch, s.weight_copies]
        rows.append(
            [str(s.stage), str(s.rank), f"[{s.layers[0]}, {s.layers[1]})", _count(s.parameters)]
            + [format_size(n) for n in sizes]
            + [str(s.in_flight), format_size(s.step_peak), format_size(s.peak)]
        )
    lines = [_title(report), _table(rows)]
    if report.config.schedule.stages_per_rank > 1:
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


def format_sequence_saving(report: MemoryReport, without: MemoryReport) -> str:
    """What sequence parallelism saves: the peak against the same layout's without it."""
    saved = without.peak - report.peak
    share = saved / without.peak if without.peak else 0.0
    return (
        f"sequence parallelism: peak {format_size(report.peak)}, {format_size(saved)} "
        f"({share:.0%}) less than without it ({format_size(without.peak)}): the activations "
        f"between blocks and across stages are 1/{report.config.parallel.tp} of the sequence"
    )


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
    model, specs = c.model.config(), c.model.specs()
    rows = [
        ["stage", "states", "DeepSpeed ZeRO-2", "stash × in flight", "Megatron (flash)", "Megatron"]
    ]
    for s in report.stages:
        blocks = sum(specs[i].name == "block" for i in range(*s.layers))
        shape = {"seq_len": c.batch.seq_len, "micro_batch_size": c.micro_batch_size}
        shape |= {"hidden": model.d_model, "heads": model.n_head, "layers": blocks}
        sizes = (
            s.weights + s.gradients + s.optimizer,
            deepspeed_zero2_model_states(s.parameters, c.parallel.dp),
            s.kept_per_micro_batch * s.in_flight,
            s.in_flight * megatron_activations(**shape, flash=True),
            s.in_flight * megatron_activations(**shape, flash=False),
        )
        rows.append([str(s.stage), *map(format_size, sizes)])
    return "reference formulas (per stage, in-flight micro-batches included):\n" + _table(rows)
