"""Schedules people read and write: rows of action tokens, as text or in CSV/text files.

A schedule file has one row of action tokens per rank and a `#` header with what the tokens
cannot say (name, stage placement, micro-batches); loading validates before anything runs.
Tests and users write rows by hand to run a schedule no generator makes (`parse_schedule`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from engine.schedule.actions import Action, format_actions, parse_actions
from engine.schedule.schedule import Schedule
from engine.schedule.validate import validate

__all__ = ["load_schedule", "parse_schedule", "save_schedule"]


def parse_schedule(
    rows: Sequence[str],
    *,
    micro_batches: int,
    placement: Sequence[int] | None = None,
    name: str = "custom",
) -> Schedule:
    """A schedule from one text row per rank (`"0F0 0F1 0B0 0B1"`); stage s on rank s by default.

    It is marked lowered when any row holds a send or receive.
    """
    parsed = tuple(tuple(parse_actions(row)) for row in rows)
    places = tuple(range(len(rows)) if placement is None else placement)
    return Schedule(
        name=name,
        num_ranks=len(rows),
        num_stages=len(places),
        micro_batches=micro_batches,
        placement=places,
        rows=parsed,
        lowered=any(not a.is_compute for row in parsed for a in row),
    )


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
