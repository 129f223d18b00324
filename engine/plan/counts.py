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
from engine.schedule.arrays import B, F, I, RowArrays, W, compute_arrays
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
    """`in_flight` and `held_with_gradients` of every stage by prefix sums over its rank's
    compute row (the search counts schedules of tens of thousands of actions), each rank's
    states together, and the input gradients held (`held_in`)."""
    rows = compute_arrays(schedule)
    before, after = [0] * schedule.num_stages, [0] * schedule.num_stages
    together = []
    for rank, row in enumerate(rows):
        mine = schedule.stages_of(rank)
        live, started = [], []
        for s in mine:
            on = row.stage == s
            closes = on & ((row.kind == B) | (row.kind == W))
            live.append(np.cumsum((on & (row.kind == F)).astype(np.int64) - closes))
            started.append(np.logical_or.accumulate(on & ((row.kind == B) | (row.kind == I))))
            before[s] = int(live[-1].max(initial=0))
            after[s] = int(live[-1][started[-1]].max(initial=0))
        together.append(_together(row, live, started) if len(mine) > 1 else None)
    return StageCounts(
        before=tuple(before),
        after=tuple(after),
        together=tuple(together),
        sent_back=held_in(rows, schedule.placement),
    )


def _together(
    row: RowArrays, live: Sequence[np.ndarray], started: Sequence[np.ndarray]
) -> frozenset[tuple[int, ...]]:
    """A rank's states after each action that adds bytes (a forward, a stage's first
    backward): its stages' in-flight counts, then 1 for each whose gradients exist."""
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
