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

State = tuple[int, ...]
"""A rank's stages' in-flight counts, then 1 for each whose gradients exist."""


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
    return StageCounts(
        before=before,
        after=after,
        together=_all_together(flat, schedule),
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


def _all_together(flat: FlatArrays, schedule: Schedule) -> tuple[frozenset[State] | None, ...]:
    """`_together` of every rank of several stages (None for a rank of one), all ranks at
    once where each holds as many stages."""
    mine = [schedule.stages_of(rank) for rank in range(schedule.num_ranks)]
    k = len(mine[0]) if mine else 0
    if k < 2 or any(len(stages) != k for stages in mine):
        return tuple(
            _together(flat.row(rank), stages) if len(stages) > 1 else None
            for rank, stages in enumerate(mine)
        )
    column = np.zeros(schedule.num_stages, dtype=np.int64)
    for stages in mine:
        column[list(stages)] = np.arange(k)
    column = column[flat.stage]
    kind = flat.kind
    step = (kind == F).astype(np.int64) - ((kind == B) | (kind == W))
    backward = (kind == B) | (kind == I)
    live = _running_per_rank(flat, column, step, k)
    seen = _running_per_rank(flat, column, backward.astype(np.int64), k)
    first = backward & (seen[np.arange(len(kind)), column] == 1)
    grown = (kind == F) | first
    states = np.concatenate([live, (seen > 0).astype(np.int64)], axis=1)[grown]
    return _uncovered_per_rank(flat.rank[grown], states, schedule.num_ranks)


def _running_per_rank(
    flat: FlatArrays, column: np.ndarray, values: np.ndarray, k: int
) -> np.ndarray:
    """Per action, the running sums of `values` over its rank's row so far, one column per
    stage of the rank (`column`: the action's)."""
    spread = np.zeros((len(values), k), dtype=np.int64)
    spread[np.arange(len(values)), column] = values
    running = np.cumsum(spread, axis=0)
    before = np.vstack([np.zeros((1, k), dtype=np.int64), running])[flat.starts[:-1]]
    return running - before[flat.rank]


def _uncovered_per_rank(
    ranks: np.ndarray, states: np.ndarray, num_ranks: int
) -> tuple[frozenset[State], ...]:
    """`_uncovered` of each rank's states (`ranks`: each state's rank, in rank order), every
    rank at once: each pass keeps each rank's largest state left (the first of the largest
    sum) and drops the states it covers, so the passes are as many as the most states a rank
    keeps."""
    kept: list[set[State]] = [set() for _ in range(num_ranks)]
    if not len(states):
        return tuple(frozenset(k) for k in kept)
    owners, starts = np.unique(ranks, return_index=True)
    segment = np.repeat(np.arange(len(starts)), np.diff(np.append(starts, len(ranks))))
    sums, index = states.sum(axis=1), np.arange(len(states))
    alive = np.ones(len(states), dtype=bool)
    while alive.any():
        score = np.where(alive, sums, -1)
        best = np.maximum.reduceat(score, starts)
        first = np.where(alive & (score == best[segment]), index, len(states))
        top = np.minimum.reduceat(first, starts)
        found = top < len(states)
        for rank, state in zip(owners[found].tolist(), states[top[found]].tolist(), strict=True):
            kept[rank].add(tuple(state))
        tops = np.where(found[:, None], states[np.minimum(top, len(states) - 1)], -1)
        alive &= ~(states <= tops[segment]).all(axis=1)
    return tuple(frozenset(k) for k in kept)


def _together(row: RowArrays, mine: Sequence[int]) -> frozenset[State]:
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


def _uncovered(states: np.ndarray) -> frozenset[State]:
    """The states (rows) no other is at least as large as in every place: only those can
    peak. The largest left is never covered; it is kept and every state it covers dropped,
    so the loop runs once per state kept (a few), not once per state."""
    left, kept = states, []
    while len(left):
        top = left[np.argmax(left.sum(axis=1))]
        kept.append(tuple(top.tolist()))
        left = left[~(left <= top).all(axis=1)]
    return frozenset(kept)
