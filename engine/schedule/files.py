"""Schedules people can read, write and look at: text/CSV files, timeline plots, Chrome traces.

A schedule file has one row of action tokens per rank and a `#` header with what the tokens
cannot say (name, stage placement, micro-batches); loading validates before anything runs.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from engine.schedule.actions import Action, ActionKind, format_actions, parse_actions
from engine.schedule.generators import SCHEDULES, Schedule, make_schedule
from engine.schedule.simulate import SimResult, TimedAction, simulate
from engine.schedule.validate import ScheduleError, validate

__all__ = [
    "KIND_COLOURS",
    "check_fits",
    "chrome_trace",
    "load_schedule",
    "plot_timeline",
    "save_schedule",
    "schedule_for",
]

KIND_COLOURS = {
    ActionKind.F: "#4C72B0",
    ActionKind.B: "#DD8452",
    ActionKind.I: "#C44E52",
    ActionKind.W: "#55A868",
}


def save_schedule(schedule: Schedule, path: str | Path, *, fmt: str = "csv") -> None:
    """Write one row per rank (`csv`: comma-separated, `text`: space-separated)."""
    if fmt not in ("csv", "text"):
        raise ValueError(f"unknown schedule format {fmt!r}: use csv or text")
    sep = "," if fmt == "csv" else " "
    header = (
        f"# meshpipe schedule name={schedule.name} micro_batches={schedule.micro_batches} "
        f"placement={','.join(map(str, schedule.placement))}\n"
    )
    body = "".join(
        (format_actions(row).replace(" ", sep) if row else "") + "\n" for row in schedule.rows
    )
    Path(path).write_text(header + body, encoding="utf-8")


def _header(lines: Sequence[str]) -> dict[str, str]:
    fields: dict[str, str] = {}
    for line in lines:
        if line.startswith("#"):
            for part in line.lstrip("# ").split():
                key, sep, value = part.partition("=")
                if sep:
                    fields[key] = value
    return fields


def schedule_for(
    name_or_file: str, *, num_ranks: int, micro_batches: int, stages_per_rank: int = 1
) -> Schedule:
    """The compute schedule a run executes: a registered generator by name, or a schedule file
    (`meshpipe schedule --out`, or written by hand) checked against the run's layout."""
    if name_or_file in SCHEDULES:
        return make_schedule(
            name_or_file,
            num_ranks=num_ranks,
            micro_batches=micro_batches,
            stages_per_rank=stages_per_rank,
        )
    if not Path(name_or_file).is_file():
        looks_like_a_path = "/" in name_or_file or Path(name_or_file).suffix != ""
        if looks_like_a_path:
            raise ValueError(
                f"schedule file {name_or_file} does not exist: give an existing file "
                f"(meshpipe schedule --out FILE writes one) or one of {', '.join(SCHEDULES)}"
            )
        raise ValueError(
            f"unknown schedule {name_or_file!r}: choose one of {', '.join(SCHEDULES)}, or give "
            "a schedule file (meshpipe schedule --out FILE writes one)"
        )
    return check_fits(
        load_schedule(name_or_file),
        where=f"schedule file {name_or_file}",
        num_ranks=num_ranks,
        micro_batches=micro_batches,
        stages_per_rank=stages_per_rank,
    )


def check_fits(
    schedule: Schedule, *, where: str, num_ranks: int, micro_batches: int, stages_per_rank: int
) -> Schedule:
    """`schedule`, once it is known to be compute-only, built for the run's ranks,
    micro-batches and stages per rank, and free of deadlock (a dry run: a schedule given as
    data would otherwise hang every rank until the timeout); otherwise an error naming
    `where` and the fix."""
    if schedule.lowered:
        raise ValueError(
            f"{where} holds SEND/RECV actions: a run takes compute actions only (F, B, I, W) "
            "and places the communication itself; remove them"
        )
    if schedule.num_ranks != num_ranks:
        raise ValueError(
            f"{where} has {schedule.num_ranks} rank rows but the run has {num_ranks} pipeline "
            f"ranks: use --pp {schedule.num_ranks} or a file for {num_ranks}"
        )
    if schedule.micro_batches != micro_batches:
        raise ValueError(
            f"{where} runs {schedule.micro_batches} micro-batches but the run has "
            f"{micro_batches}: use --micro-batches {schedule.micro_batches}"
        )
    if schedule.num_stages != num_ranks * stages_per_rank:
        raise ValueError(
            f"{where} places {schedule.num_stages} stages on {num_ranks} ranks but the run has "
            f"{stages_per_rank} stage(s) per rank: use --stages-per-rank "
            f"{schedule.num_stages // num_ranks}"
        )
    try:
        simulate(schedule)
    except ScheduleError as error:
        raise ScheduleError(f"{where}: {error}") from error
    return schedule


def load_schedule(path: str | Path) -> Schedule:
    """Read a schedule file (ours, or plain rows of tokens) and validate it.

    Without a header, micro-batches and stages are inferred from the tokens and stage s is
    placed on rank s mod P.

    A blank row is a rank with no actions (`save_schedule` writes one), but blank lines at the
    end beyond the ranks the header's placement names (all of them without a header) are an
    editor's trailing newlines, not ranks, and are dropped.
    """
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as error:
        raise ValueError(f"cannot read schedule file {path}: {error}") from error
    fields = _header(lines)
    rows = [tuple(parse_actions(line)) for line in lines if not line.startswith("#")]
    actions: list[Action] = [a for row in rows for a in row]
    if not actions:
        raise ValueError(f"schedule file {path} holds no actions: write one row of tokens per rank")
    placed = tuple(int(r) for r in fields["placement"].split(",")) if "placement" in fields else ()
    named_ranks = max(placed) + 1 if placed else 0
    while len(rows) > named_ranks and not rows[-1]:
        rows.pop()
    num_ranks = len(rows)
    if placed:
        placement = placed
    else:
        stages = max(a.stage for a in actions) + 1
        placement = tuple(s % num_ranks for s in range(stages))
    schedule = Schedule(
        name=fields.get("name", "custom"),
        num_ranks=num_ranks,
        num_stages=len(placement),
        micro_batches=int(fields.get("micro_batches", max(a.micro_batch for a in actions) + 1)),
        placement=placement,
        rows=tuple(rows),
        lowered=any(not a.is_compute for a in actions),
    )
    validate(schedule)
    return schedule


def plot_timeline(result: SimResult, path: str | Path, *, title: str) -> None:
    """Draw a Gantt chart: a row per rank, a colour per action kind, micro-batch numbers."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError as error:
        raise ValueError("plotting needs matplotlib: pip install 'meshpipe[plot]'") from error
    ranks = len(result.timeline)
    fig, ax = plt.subplots(figsize=(max(6.0, result.step_time * 0.35), 0.6 * ranks + 1.2))
    for rank, row in enumerate(result.timeline):
        for timed in row:
            _draw(ax, rank, timed)
    ax.set_yticks(range(ranks), [f"rank {r}" for r in range(ranks)])
    ax.invert_yaxis()
    ax.set_xlim(0, result.step_time)
    ax.set_xlabel("time")
    ax.set_title(f"{title} — bubble {result.bubble:.1%}")
    handles = [Patch(color=c) for c in KIND_COLOURS.values()]
    ax.legend(
        handles,
        [k.value for k in KIND_COLOURS],
        loc="upper center",
        bbox_to_anchor=(0.5, -0.35 / max(1, ranks) - 0.15),
        ncols=4,
        fontsize=8,
        frameon=False,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _draw(ax: Any, rank: int, timed: TimedAction) -> None:
    action = timed.action
    if action.kind not in KIND_COLOURS or timed.end <= timed.start:
        return
    width = timed.end - timed.start
    ax.barh(rank, width, left=timed.start, color=KIND_COLOURS[action.kind], edgecolor="white")
    label = (
        f"{action.micro_batch}"
        if width < 1.5
        else f"{action.stage}{action.kind.value}{action.micro_batch}"
    )
    ax.text(
        timed.start + width / 2, rank, label, ha="center", va="center", fontsize=7, color="white"
    )


def chrome_trace(
    timelines: Sequence[Sequence[tuple[str, float, float]]],
    path: str | Path,
    *,
    unit_s: float = 1.0,
    process: str = "meshpipe",
) -> None:
    """Write Chrome/Perfetto trace JSON: one track per rank, one slice per (name, start, end).

    `unit_s` converts the times to seconds (1 for measured runs; any scale for simulations).
    """
    events: list[dict[str, object]] = [
        {"name": "process_name", "ph": "M", "pid": 0, "args": {"name": process}}
    ]
    for rank, slices in enumerate(timelines):
        events.append(
            {
                "name": "thread_name",
                "ph": "M",
                "pid": 0,
                "tid": rank,
                "args": {"name": f"rank {rank}"},
            }
        )
        for name, start, end in slices:
            events.append(
                {
                    "name": name,
                    "cat": name.lstrip("0123456789").rstrip("0123456789"),
                    "ph": "X",
                    "pid": 0,
                    "tid": rank,
                    "ts": start * unit_s * 1e6,
                    "dur": (end - start) * unit_s * 1e6,
                }
            )
    Path(path).write_text(json.dumps({"traceEvents": events}), encoding="utf-8")
