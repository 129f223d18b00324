"""A schedule's compute actions as integer arrays: every rank's in one set (`flat_arrays`),
with where its stages live (`ScheduleArrays`, `read_arrays`).

The planner counts what hundreds of schedules of tens of thousands of actions hold in flight
(`engine.plan.counts.stage_counts`, `engine.schedule.delivery.held_in`) and times them
(`engine.schedule.program.simulate_times`); a Python step per action cost it seconds, so the
rows are read once into arrays and counted with running sums over all ranks at once (a
generator's are written as arrays directly: `engine.schedule.generated_arrays`). Sends and
receives are left out: a lowered schedule counts as its compute rows."""

from __future__ import annotations

import functools
import itertools
import operator
from dataclasses import dataclass

import numpy as np

from engine.schedule.actions import ActionKind
from engine.schedule.schedule import Schedule, stages_by_rank

__all__ = [
    "B",
    "F",
    "FlatArrays",
    "I",
    "RowArrays",
    "ScheduleArrays",
    "W",
    "flat_arrays",
    "rank_stages",
    "read_arrays",
    "running_sums",
]

F, B, I, W = 0, 1, 2, 3  # noqa: E741 - the kinds' own names
_CODES = {
    kind: code for code, kind in enumerate((ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W))
}


_STAGE, _KIND, _MICRO_BATCH = (operator.itemgetter(k) for k in range(3))
"""An `Action`'s fields by position."""


@dataclass(frozen=True, eq=False)
class RowArrays:
    """One rank's compute actions in order: kind (`F`, `B`, `I`, `W`), stage, micro-batch."""

    kind: np.ndarray
    stage: np.ndarray
    micro_batch: np.ndarray

    def __len__(self) -> int:
        return len(self.kind)


@dataclass(frozen=True, eq=False)
class FlatArrays:
    """Every rank's compute actions in one set of arrays, rank after rank: what can be
    counted for all ranks at once. `position` is an action's index in its rank's compute
    row; rank r's actions are `starts[r]:starts[r + 1]`."""

    rank: np.ndarray
    position: np.ndarray
    kind: np.ndarray
    stage: np.ndarray
    micro_batch: np.ndarray
    starts: np.ndarray

    @classmethod
    def of_rows(
        cls, kind: np.ndarray, stage: np.ndarray, micro_batch: np.ndarray, lengths: np.ndarray
    ) -> FlatArrays:
        """Rows laid rank after rank, `lengths[r]` actions of rank r: each action's rank,
        its place in its row and where each row starts, worked out from the lengths."""
        starts = np.zeros(len(lengths) + 1, dtype=np.int64)
        starts[1:] = np.cumsum(lengths)
        rank = np.repeat(np.arange(len(lengths)), lengths)
        return cls(
            rank=rank,
            position=np.arange(len(kind)) - starts[rank],
            kind=kind,
            stage=stage,
            micro_batch=micro_batch,
            starts=starts,
        )

    def row(self, rank: int) -> RowArrays:
        at = slice(int(self.starts[rank]), int(self.starts[rank + 1]))
        return RowArrays(kind=self.kind[at], stage=self.stage[at], micro_batch=self.micro_batch[at])


def flat_arrays(schedule: Schedule) -> FlatArrays:
    """Every rank's compute actions as arrays, each field read in one pass over the actions
    (named tuples, read by `itemgetter` in C). Not `zip(*actions)`: that makes an iterator
    per action, and the collector's passes over them cost 20 times the reading (76 ms against
    3 ms for ZB-H1 at 64 ranks and 256 micro-batches)."""
    actions = list(itertools.chain.from_iterable(schedule.rows))
    lengths = np.array([len(row) for row in schedule.rows], dtype=np.int64)
    n = len(actions)
    kinds = map(_CODES.get, map(_KIND, actions), itertools.repeat(-1))
    codes = np.fromiter(kinds, np.int8, n)
    rank = np.repeat(np.arange(len(lengths)), lengths)
    compute = codes >= 0
    stages = np.fromiter(map(_STAGE, actions), np.int64, n)[compute]
    micro_batches = np.fromiter(map(_MICRO_BATCH, actions), np.int64, n)[compute]
    per_rank = np.bincount(rank[compute], minlength=len(lengths))
    return FlatArrays.of_rows(codes[compute], stages, micro_batches, per_rank)


@dataclass(frozen=True, eq=False)
class ScheduleArrays:
    """A compute-only schedule as the planner counts and compiles it: where its stages live,
    its micro-batches, and its rows as arrays (`read_arrays` of its actions, or written
    without them: `engine.schedule.generated_arrays`)."""

    flat: FlatArrays
    placement: tuple[int, ...]
    micro_batches: int

    @property
    def num_stages(self) -> int:
        return len(self.placement)

    @property
    def num_ranks(self) -> int:
        return len(self.flat.starts) - 1

    def rows(self) -> tuple[RowArrays, ...]:
        """Every rank's compute actions, one set of arrays per rank."""
        return tuple(self.flat.row(rank) for rank in range(self.num_ranks))


def read_arrays(schedule: Schedule) -> ScheduleArrays:
    """The schedule's compute rows read from its actions (`flat_arrays`)."""
    return ScheduleArrays(flat_arrays(schedule), schedule.placement, schedule.micro_batches)


def running_sums(values: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """The running sums of `values` (along the first axis) restarting at each of `starts`
    (ascending, the first 0): a count kept per stage or per rank over one flat array."""
    running = np.cumsum(values, axis=0)
    before = np.concatenate([np.zeros_like(running[:1]), running])[starts]
    lengths = np.diff(np.append(starts, len(values)))
    return running - np.repeat(before, lengths, axis=0)


@functools.lru_cache(maxsize=1024)
def rank_stages(placement: tuple[int, ...]) -> np.ndarray:
    """Each rank's stages in order, one row per rank. Every rank must hold as many, as the
    generators' placements do: the planner counts and composes only those."""
    rows = stages_by_rank(placement, 1 + max(placement))
    if len({len(row) for row in rows}) != 1:
        raise ValueError(
            f"placement {placement} gives its ranks different numbers of stages: the planner "
            "counts and composes the generators' placements, v stages on every rank"
        )
    return np.array(rows, dtype=np.int64)
