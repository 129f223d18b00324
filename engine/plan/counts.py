"""What each stage of a schedule holds at once, counted from its rows: micro-batches in
flight, those held once its gradients exist, each rank's stages' states together, and the
input gradients it sent back not yet known delivered. The planner's screen multiplies these
by per-layer bytes (`engine.plan.budget`); they are read off the same schedule the runtime
runs, as prefix sums over each rank's compute row (`engine.schedule.arrays`), because the
search counts hundreds of schedules of tens of thousands of actions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from engine.schedule import Schedule
from engine.schedule.arrays import (
    B,
    F,
    FlatArrays,
    I,
    ScheduleArrays,
    W,
    rank_stages,
    read_arrays,
    running_sums,
)
from engine.schedule.delivery import held_in

__all__ = ["StageCounts", "State", "counts_from_payload", "counts_payload", "stage_counts"]

State = tuple[int, ...]
"""Four columns of a rank's stages each: micro-batches awaiting their W, those awaiting their
I, those awaiting a fused B, then 1 for each stage whose gradients exist. A state another
covers (no larger in any column) holds no more bytes whatever each stash costs: a split
micro-batch can hold less awaiting its W than awaiting its I (W needs only its Linears'
inputs and output gradients)."""


@dataclass(frozen=True, kw_only=True)
class StageCounts:
    """Per stage of a schedule: micro-batches in flight, those held once gradients exist, and
    input gradients sent back and held."""

    before: tuple[int, ...]
    after: tuple[int, ...]
    together: tuple[frozenset[tuple[int, ...]] | None, ...] = ()
    """Per rank of several stages, the states its stages reach at once (`State`, its stages in
    `rank_stages` order), none another covers.
    None (or nothing) where unknown; a rank's stages then count their most at once."""
    sent_back: tuple[int, ...]
    """The most input gradients each stage holds sent back at once, not yet proved delivered
    (`held_input_gradients`)."""
    fused: tuple[bool, ...] = ()
    """Per stage, whether its every backward is a fused B (no I): its forwards keep what a
    fused backward needs, not what a split one does (ZB-H1's first stage). Empty: unknown."""
    awaiting: tuple[tuple[tuple[int, int], ...], ...] = ()
    """Per stage, from its first backward on, the (awaiting I or B, awaiting W) micro-batch
    counts it reaches, none another covers: a split micro-batch holds other bytes between
    its I and its W than before its I. Empty: unknown (`after` of either kind)."""
    warm: tuple[int, ...] = ()
    """Per stage, the micro-batches in flight when its first backward (B or I) begins: all
    it holds before it runs one (`before` counts those awaiting a W too). Empty: unknown."""


def stage_counts(schedule: Schedule | ScheduleArrays) -> StageCounts:
    """`in_flight` and `held_with_gradients` of every stage by prefix sums over its compute
    actions, all stages at once (the search counts schedules of tens of thousands of
    actions), each rank's states together, and the input gradients held (`held_in`). The
    search hands in a generator's rows as arrays (`schedule_arrays`), never built."""
    arrays = read_arrays(schedule) if isinstance(schedule, Schedule) else schedule
    flat, stages = arrays.flat, arrays.num_stages
    rows = _by_stage(flat)
    before, after, warm = _in_flight(rows, stages)
    return StageCounts(
        before=before,
        after=after,
        warm=warm,
        together=_all_together(arrays),
        sent_back=held_in(flat, arrays.placement),
        fused=_fused(flat, stages),
        awaiting=_awaiting(rows, stages, after),
    )


def counts_payload(counts: StageCounts) -> dict[str, Any]:
    """`counts` as JSON, for the search to keep on disk (`SearchContext.counts`)."""
    return {
        "before": list(counts.before),
        "after": list(counts.after),
        "together": [None if s is None else sorted(map(list, s)) for s in counts.together],
        "sent_back": list(counts.sent_back),
        "fused": list(counts.fused),
        "awaiting": [[list(pair) for pair in pairs] for pairs in counts.awaiting],
        "warm": list(counts.warm),
    }


def counts_from_payload(payload: dict[str, Any]) -> StageCounts:
    """The counts `counts_payload` wrote; KeyError, TypeError or ValueError where it is not
    such a payload."""
    return StageCounts(
        before=tuple(int(n) for n in payload["before"]),
        after=tuple(int(n) for n in payload["after"]),
        together=tuple(
            None if s is None else frozenset(tuple(int(n) for n in state) for state in s)
            for s in payload["together"]
        ),
        sent_back=tuple(int(n) for n in payload["sent_back"]),
        fused=tuple(bool(x) for x in payload["fused"]),
        awaiting=tuple(tuple((int(i), int(w)) for i, w in pairs) for pairs in payload["awaiting"]),
        warm=tuple(int(n) for n in payload["warm"]),
    )


@dataclass(frozen=True)
class _StageRows:
    """Every stage's actions together, each stage's in its rank's order (a stage's actions
    lie on one rank): their stages and kinds, where each stage's run starts, and whether the
    stage's first backward (B or I) has run by each action."""

    stage: np.ndarray
    kind: np.ndarray
    starts: np.ndarray
    began: np.ndarray


def _by_stage(flat: FlatArrays) -> _StageRows | None:
    """The actions of `flat` grouped by stage; None when there are none."""
    order = np.argsort(flat.stage, kind="stable")
    stage, kind = flat.stage[order], flat.kind[order]
    if not len(stage):
        return None
    starts = np.flatnonzero(np.diff(stage, prepend=-1))
    began = running_sums(((kind == B) | (kind == I)).astype(np.int64), starts) > 0
    return _StageRows(stage=stage, kind=kind, starts=starts, began=began)


def _awaiting(
    rows: _StageRows | None, stages: int, after: tuple[int, ...]
) -> tuple[tuple[tuple[int, int], ...], ...]:
    """Per stage, the (awaiting I or B, awaiting W) counts after each of its actions from
    its first backward on (`_in_flight`'s running sums, split in two), those no other covers
    (no larger in either): one of them holds the most, whatever each stash costs
    (`budget._stage_parts`). Without an I every stage's one state is its `after`."""
    if rows is None or not (rows.kind == I).any():
        return tuple(((n, 0),) for n in after)
    stage, kind, starts, began = rows.stage, rows.kind, rows.starts, rows.began
    before_i = running_sums((kind == F).astype(np.int64) - ((kind == B) | (kind == I)), starts)
    before_w = running_sums((kind == I).astype(np.int64) - (kind == W), starts)
    states = np.column_stack([before_i, before_w])[began]
    found = _uncovered_pairs(stage[began], states, stages)
    return tuple(
        tuple(sorted(((i, w) for i, w in pairs), reverse=True)) or ((0, 0),) for pairs in found
    )


def _fused(flat: FlatArrays, stages: int) -> tuple[bool, ...]:
    """Per stage, whether no I of it runs: every backward of it is a fused B."""
    split = np.zeros(stages, dtype=bool)
    split[flat.stage[flat.kind == I]] = True
    return tuple((~split).tolist())


def _in_flight(
    rows: _StageRows | None, stages: int
) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """Per stage, the most micro-batches in flight (a forward opens one, B or W closes it),
    the most from its first backward (B or I) on, and the most before it (its warm-up):
    running sums over each stage's own actions."""
    before, after = np.zeros(stages, np.int64), np.zeros(stages, np.int64)
    warm = np.zeros(stages, np.int64)
    if rows is None:
        return tuple(before.tolist()), tuple(after.tolist()), tuple(warm.tolist())
    stage, kind, starts = rows.stage, rows.kind, rows.starts
    step = (kind == F).astype(np.int64) - ((kind == B) | (kind == W))
    live = running_sums(step, starts)
    before[stage[starts]] = np.maximum(np.maximum.reduceat(live, starts), 0)
    gradients = np.where(rows.began, live, 0)
    after[stage[starts]] = np.maximum(np.maximum.reduceat(gradients, starts), 0)
    warm[stage[starts]] = np.maximum(np.maximum.reduceat(np.where(rows.began, 0, live), starts), 0)
    return tuple(before.tolist()), tuple(after.tolist()), tuple(warm.tolist())


def _all_together(arrays: ScheduleArrays) -> tuple[frozenset[State] | None, ...]:
    """Per rank of several stages, its states (`State`, stages in `rank_stages` order) after
    each action that can add bytes (a forward, an I, a stage's first backward), none another
    covers; None for a rank of one stage. The three stashes differ (DualPipeV's overlapped
    pairs run fused, its last ones split; a split one holds more from its I to its W), so
    each is counted apart."""
    flat, mine = arrays.flat, rank_stages(arrays.placement)
    k = mine.shape[1]
    if k < 2:
        return (None,) * arrays.num_ranks
    column = np.zeros(arrays.num_stages, dtype=np.int64)
    column[mine] = np.arange(k)
    column = column[flat.stage]
    kind = flat.kind
    split = _split_micro_batches(flat)
    forward = (kind == F).astype(np.int64)
    steps = (
        forward * ~split - (kind == B),
        forward * split - (kind == I),
        (kind == I).astype(np.int64) - (kind == W),
    )
    backward = (kind == B) | (kind == I)
    on_b, on_i, on_w = (_running_per_rank(flat, column, step, k) for step in steps)
    stashes = [on_w, on_i, on_b]
    seen = _running_per_rank(flat, column, backward.astype(np.int64), k)
    first = backward & (seen[np.arange(len(kind)), column] == 1)
    grown = (kind == F) | (kind == I) | first
    states = np.concatenate([*stashes, (seen > 0).astype(np.int64)], axis=1)[grown]
    return _uncovered_per_rank(flat.rank[grown], states, arrays.num_ranks)


def _split_micro_batches(flat: FlatArrays) -> np.ndarray:
    """Per action, whether its micro-batch's backward at its stage is split (an I of the same
    stage and micro-batch runs)."""
    key = flat.stage * (int(flat.micro_batch.max(initial=0)) + 1) + flat.micro_batch
    return np.isin(key, key[flat.kind == I])


def _running_per_rank(
    flat: FlatArrays, column: np.ndarray, values: np.ndarray, k: int
) -> np.ndarray:
    """Per action, the running sums of `values` over its rank's row so far, one column per
    stage of the rank (`column`: the action's)."""
    spread = np.zeros((len(values), k), dtype=np.int64)
    spread[np.arange(len(values)), column] = values
    return running_sums(spread, flat.starts[:-1])


def _uncovered_per_rank(
    ranks: np.ndarray, states: np.ndarray, num_ranks: int
) -> tuple[frozenset[State], ...]:
    """Each rank's states (`ranks`: each state's rank, in rank order) that no other of its
    states is at least as large as in every place: only those can peak. The largest left is
    never covered; each pass keeps each rank's largest state left (the first of the largest
    sum) and drops every state it covers, so the passes are as many as the most states a rank
    keeps, for every rank at once, each over the states left."""
    kept: list[set[State]] = [set() for _ in range(num_ranks)]
    ranks, states = _below_the_next_dropped(ranks, states)
    while len(states):
        starts = np.flatnonzero(np.diff(ranks, prepend=-1))
        segment = np.repeat(np.arange(len(starts)), np.diff(np.append(starts, len(ranks))))
        sums = states.sum(axis=1)
        largest = sums == np.maximum.reduceat(sums, starts)[segment]
        top = np.minimum.reduceat(np.where(largest, np.arange(len(states)), len(states)), starts)
        for rank, state in zip(ranks[starts].tolist(), states[top].tolist(), strict=True):
            kept[rank].add(tuple(state))
        left = ~(states <= states[top][segment]).all(axis=1)  # a top covers itself
        ranks, states = ranks[left], states[left]
    return tuple(frozenset(k) for k in kept)


def _uncovered_pairs(
    groups: np.ndarray, pairs: np.ndarray, num_groups: int
) -> tuple[frozenset[State], ...]:
    """`_uncovered_per_rank` of two columns, in one sort: within each group, ordered by the
    first column and then the second, both descending, a pair is covered by none other
    exactly when its second column is above every earlier pair's (each earlier one's first
    column is at least its own), so one running maximum finds them all (a duplicate's
    second copy is not above the first: one is kept). A quarter of a 405b search's counting
    went to `_uncovered_per_rank`'s passes over the awaiting pairs."""
    kept: list[set[State]] = [set() for _ in range(num_groups)]
    if not len(pairs):
        return tuple(frozenset(k) for k in kept)
    first, second = pairs[:, 0], pairs[:, 1]
    order = np.lexsort((-second, -first, groups))
    groups, first, second = groups[order], first[order], second[order]
    # each group's values lifted above every earlier group's: one running maximum for all
    lifted = second + np.cumsum(np.diff(groups, prepend=groups[0]) != 0) * (
        int(second.max()) - int(second.min()) + 1
    )
    before = np.maximum.accumulate(lifted)
    above = np.empty(len(lifted), dtype=bool)
    above[0] = True
    above[1:] = lifted[1:] > before[:-1]
    for group, a, b in zip(
        groups[above].tolist(), first[above].tolist(), second[above].tolist(), strict=True
    ):
        kept[group].add((a, b))
    return tuple(frozenset(k) for k in kept)


def _below_the_next_dropped(ranks: np.ndarray, states: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The states without those the next state of the same rank covers (a forward followed
    by another only adds): most of a row, in a few vectorised passes, before the pairwise
    passes of `_uncovered_per_rank`."""
    while len(states) > 1:
        covered = np.append(
            (ranks[:-1] == ranks[1:]) & (states[:-1] <= states[1:]).all(axis=1), False
        )
        if not covered.any():
            break
        ranks, states = ranks[~covered], states[~covered]
    return ranks, states
