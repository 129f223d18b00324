"""What each stage of a schedule holds at once, counted from its rows: micro-batches in
flight, those held once its gradients exist, each rank's stages' states together, and the
input gradients it sent back not yet known delivered. The planner's screen multiplies these
by per-layer bytes (`engine.plan.budget`); they are read off the same schedule the runtime
runs, as prefix sums over each rank's compute row (`engine.schedule.arrays`), because the
search counts hundreds of schedules of tens of thousands of actions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from engine.schedule import Schedule
from engine.schedule.arrays import B, F, FlatArrays, I, RowArrays, W, flat_arrays
from engine.schedule.delivery import held_in

__all__ = ["StageCounts", "stage_counts"]


@dataclass(frozen=True, kw_only=True)
class StageCounts:
    """Per stage of a schedule: micro-batches in flight, those held once gradients exist, and
    input gradients sent back and held."""

    before: tuple[int, ...]
    after: tuple[int, ...]
    together: tuple[frozenset[tuple[int, ...]] | None, ...] = ()
    """Per rank of several stages, the states its stages reach at once: each their in-flight
    counts, then 1 for each whose gradients exist (`stages_of` order), none another covers.
    None (or nothing) where unknown; a rank's stages then count their most at once."""
    sent_back: tuple[int, ...]
    """The most input gradients each stage holds sent back at once, not yet proved delivered
    (`held_input_gradients`)."""


def stage_counts(schedule: Schedule) -> StageCounts:
    """`in_flight` and `held_with_gradients` of every stage by prefix sums over its compute
    actions, all stages at once (the search counts schedules of tens of thousands of
    actions), each rank's states together, and the input gradients held (`held_in`)."""
    flat = flat_arrays(schedule)
    before, after = _in_flight(flat, schedule.num_stages)
    together = [
        _together(flat.row(rank), schedule.stages_of(rank))
        if len(schedule.stages_of(rank)) > 1
        else None
        for rank in range(schedule.num_ranks)
    ]
    return StageCounts(
        before=before,
        after=after,
        together=tuple(together),
        sent_back=held_in(flat, schedule.placement),
    )


def _in_flight(flat: FlatArrays, stages: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Per stage, the most micro-batches in flight (a forward opens one, B or W closes it),
    and the most from its first backward (B or I) on: running sums over each stage's own
    actions, which lie on one rank in that rank's order."""
    before, after = np.zeros(stages, np.int64), np.zeros(stages, np.int64)
    order = np.argsort(flat.stage, kind="stable")
    stage, kind = flat.stage[order], flat.kind[order]
    if not len(stage):
        return tuple(before.tolist()), tuple(after.tolist())
    starts = np.flatnonzero(np.diff(stage, prepend=-1))
    lengths = np.diff(np.append(starts, len(stage)))
    step = (kind == F).astype(np.int64) - ((kind == B) | (kind == W))
    live = np.cumsum(step)
    live -= np.repeat(live[starts] - step[starts], lengths)
    began = np.cumsum((kind == B) | (kind == I))
    began -= np.repeat(began[starts] - ((kind[starts] == B) | (kind[starts] == I)), lengths)
    before[stage[starts]] = np.maximum(np.maximum.reduceat(live, starts), 0)
    gradients = np.where(began > 0, live, 0)
    after[stage[starts]] = np.maximum(np.maximum.reduceat(gradients, starts), 0)
    return tuple(before.tolist()), tuple(after.tolist())


def _together(row: RowArrays, mine: Sequence[int]) -> frozenset[tuple[int, ...]]:
    """A rank's states after each action that adds bytes (a forward, a stage's first
    backward): its stages' in-flight counts, then 1 for each whose gradients exist."""
    live, started = [], []
    for s in mine:
        on = row.stage == s
        closes = on & ((row.kind == B) | (row.kind == W))
        live.append(np.cumsum((on & (row.kind == F)).astype(np.int64) - closes))
        started.append(np.logical_or.accumulate(on & ((row.kind == B) | (row.kind == I))))
    grown = row.kind == F
    for began in started:
        if began.any():
            grown[int(np.argmax(began))] = True
    states = np.stack([*live, *(b.astype(np.int64) for b in started)], axis=1)[grown]
    return _uncovered(states)


def _uncovered(states: np.ndarray) -> frozenset[tuple[int, ...]]:
    """The states (rows) no other is at least as large as in every place: only those can
    peak. The largest left is never covered; it is kept and every state it covers dropped,
    so the loop runs once per state kept (a few), not once per state."""
    left, kept = states, []
    while len(left):
        top = left[np.argmax(left.sum(axis=1))]
        kept.append(tuple(top.tolist()))
        left = left[~(left <= top).all(axis=1)]
    return frozenset(kept)
