"""A schedule's compute actions as integer arrays, one set per rank.

The planner counts what hundreds of schedules of tens of thousands of actions hold in flight
(`engine.plan.counts.stage_counts`, `engine.schedule.delivery.held_in`); a
Python step per action cost it seconds, so the rows are read once into arrays and counted
with prefix sums. Sends and receives are left out: a lowered schedule counts as its compute
rows.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from operator import attrgetter

import numpy as np

from engine.schedule.actions import ActionKind
from engine.schedule.schedule import Schedule

__all__ = ["B", "F", "I", "RowArrays", "W", "compute_arrays"]

F, B, I, W = 0, 1, 2, 3  # noqa: E741 - the kinds' own names
_CODES = {
    id(kind): code
    for code, kind in enumerate((ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W))
}
"""By identity: an enum member's hash runs Python code, too slow over a planner's schedules."""
_KIND, _STAGE, _MICRO_BATCH = attrgetter("kind"), attrgetter("stage"), attrgetter("micro_batch")


@dataclass(frozen=True, eq=False)
class RowArrays:
    """One rank's compute actions in order: kind (`F`, `B`, `I`, `W`), stage, micro-batch."""

    kind: np.ndarray
    stage: np.ndarray
    micro_batch: np.ndarray

    def __len__(self) -> int:
        return len(self.kind)


def compute_arrays(schedule: Schedule) -> tuple[RowArrays, ...]:
    """Every rank's compute actions as arrays."""
    found = []
    for row in schedule.rows:
        n = len(row)
        codes = map(_CODES.get, map(id, map(_KIND, row)), itertools.repeat(-1))
        kind = np.fromiter(codes, np.int8, n)
        stage = np.fromiter(map(_STAGE, row), np.int64, n)
        micro_batch = np.fromiter(map(_MICRO_BATCH, row), np.int64, n)
        compute = kind >= 0
        if not compute.all():
            kind, stage, micro_batch = kind[compute], stage[compute], micro_batch[compute]
        found.append(RowArrays(kind=kind, stage=stage, micro_batch=micro_batch))
    return tuple(found)
