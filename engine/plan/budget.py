"""Per-rank memory of a candidate layout, fast enough to screen thousands of them.

The terms are the memory model's own: each distinct layer is traced once on fake tensors
(`engine.memory.fitting.layer_sums`, one sequence per micro-batch: what a forward keeps, its
weight copies, its highest transient, all proportional to the micro-batch size) and its model
states follow from its parameter shapes under the ZeRO level (`engine.memory.sharding`). A
stage holds its states, then, as `engine.memory.fitting.stage_bytes` composes them, its
in-flight stashes (the schedule's counts) or its gradients with the stashes still held once
they exist, plus the highest transient. Under full recompute a stage keeps only its input per
micro-batch and regenerates one micro-batch's activations during each backward. A rank holds
the sum of its stages. `meshpipe memory --plan FILE` replays the chosen plan exactly.
"""

from __future__ import annotations

import functools
import itertools
import operator
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from engine.memory.fitting import layer_sums
from engine.memory.replay import StageShape
from engine.memory.sharding import sharded_states
from engine.memory.states import StateLayout, stage_params
from engine.memory.tracker import CUDA_BLOCK, round_up
from engine.schedule import Schedule
from engine.schedule.arrays import B, F, I, RowArrays, W, compute_arrays
from engine.schedule.delivery import held_in
from models import LayerSpec

__all__ = [
    "LayerBytes",
    "StageCounts",
    "layer_bytes",
    "rank_floor",
    "rank_peaks",
    "stage_counts",
    "stage_floor",
    "state_sums",
]


@dataclass(frozen=True, kw_only=True)
class LayerBytes:
    """Per layer, bytes for one sequence per micro-batch (activations) or one replica (states)."""

    kept: tuple[int, ...]
    """What one forward keeps until its backward, less the input the stage received."""
    transient: tuple[int, ...]
    received: int
    """The input a stage receives per sequence (what full recompute keeps)."""
    weights: tuple[int, ...]
    """Kept across steps, with the optimizer's states."""
    gradients: tuple[int, ...]
    during: tuple[int, ...]
    """Step-long copies: autocast's weight casts, or ZeRO-3's gathered layers."""

    @functools.cached_property
    def prefix(self) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        """Prefix sums of (weights and step-long copies, gradients, kept): a stage's sum of
        each is one difference (the screen sums stages hundreds of thousands of times)."""
        fixed = itertools.accumulate(map(operator.add, self.weights, self.during), initial=0)
        gradients = itertools.accumulate(self.gradients, initial=0)
        return tuple(fixed), tuple(gradients), tuple(itertools.accumulate(self.kept, initial=0))


_TRACED_REPLICAS = 2
"""ZeRO-3's layers are traced under FSDP on a fake world of this many replicas, whatever the
candidate's dp: what a layer's forward keeps and its transients do not depend on the replica
count beyond the shards' padding, and one trace per layer serves every dp the search weighs
(`meshpipe memory` replays the chosen plan at its own dp exactly)."""


@functools.lru_cache(maxsize=64)
def layer_bytes(
    specs: tuple[LayerSpec, ...],
    *,
    seq_len: int,
    precision: str,
    device: str,
    tp: int,
    split: bool,
    states: StateLayout,
) -> LayerBytes:
    """Each layer's bytes, its activations traced at one sequence per micro-batch."""
    hidden = int(specs[0].config.d_model)
    shape = StageShape(
        micro_batches=1,
        micro_batch_size=1,
        seq_len=seq_len,
        hidden=hidden,
        divisor=1,
        precision=precision,
        recompute="none",
        tp=tp,
        fsdp_replicas=_TRACED_REPLICAS if states.zero == 3 else 0,
        fsdp_reshard=states.zero_reshard,
    )
    sums = layer_sums(specs, shape, device, 1, (split,))
    block = CUDA_BLOCK if device == "cuda" else 1
    size = 4 if precision == "fp32" else 2
    own = [_layer_states(spec, states, precision) for spec in specs]
    return LayerBytes(
        kept=sums.kept,
        transient=sums.transient,
        received=round_up(seq_len * hidden * size, block),
        weights=tuple(w for w, _, _ in own),
        gradients=tuple(g for _, g, _ in own),
        during=sums.copies if states.zero == 0 else tuple(c for _, _, c in own),
    )


@functools.lru_cache(maxsize=4096)
def _layer_states(spec: LayerSpec, states: StateLayout, precision: str) -> tuple[int, int, int]:
    """(weights + optimizer, gradients, step-long copies) of one layer on one replica."""
    params = stage_params((spec,), states.tp)
    if states.zero:
        sharded = sharded_states(params, states, precision=precision)
        return sharded.weights + sharded.optimizer, sharded.gradients, sharded.gathered
    fp32 = sum(round_up(4 * p.numel, states.block) for p in params)
    step = round_up(4, states.block) if states.step_counters else 0
    optimizer = sum(2 * round_up(4 * p.numel, states.block) + step for p in params)
    return fp32 + optimizer, fp32, 0


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


def state_sums(
    specs: Sequence[LayerSpec], states: StateLayout, precision: str
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Prefix sums over the layers of (weights, optimizer and ZeRO's gathered copies) and of
    gradients, from parameter shapes alone: a floor of a stage's peak without a trace."""
    fixed, grads = [0], [0]
    for spec in specs:
        weights, gradients, gathered = _layer_states(spec, states, precision)
        fixed.append(fixed[-1] + weights + (gathered if states.zero else 0))
        grads.append(grads[-1] + gradients)
    return tuple(fixed), tuple(grads)


@dataclass(frozen=True)
class _StageBytes:
    """A stage's peak in parts, so that a rank of several stages counts each part as its
    stages hold it together: states and stashes add up, one micro-batch's transients do not
    (a rank computes one action at a time)."""

    fixed: int
    kept: int
    """One micro-batch's stash."""
    grads: int
    during: int
    """The step's stashes and gradients, without the transient."""
    transient: int
    tail: int
    """The gradient reduction's buffers after the step."""
    held: int

    @property
    def peak(self) -> int:
        return self.fixed + max(self.during + self.transient, self.tail) + self.held


def _rank_bytes(parts: Sequence[_StageBytes], states: frozenset[tuple[int, ...]] | None) -> int:
    """A rank's peak: its stages' states at once (`StageCounts.together`; without them, each
    stage's most in flight) and the largest transient."""
    if states is None:
        stashes = sum(p.during for p in parts)
    else:
        k = len(parts)
        stashes = max(
            sum(p.kept * s[i] + p.grads * s[k + i] for i, p in enumerate(parts)) for s in states
        )
    during = stashes + max(p.transient for p in parts)
    tail = sum(p.tail for p in parts)
    return sum(p.fixed + p.held for p in parts) + max(during, tail)


def _stage_bytes(
    sums: LayerBytes,
    layers: range,
    *,
    before: int,
    after: int,
    micro_batch_size: int,
    recompute: bool,
    every: int,
    reduce_copy: bool,
    held: int,
) -> _StageBytes:
    """One stage's peak: states, then the larger of its step and its gradient reduction,
    plus `held`, the sends kept to the step's end (counted whole: a bound). Recomputed in
    runs of `every` layers (0: the whole stage), a forward keeps each run's input and a
    backward regenerates one run's activations at a time."""
    first, stop = layers.start, layers.stop
    fixed_sums, grad_sums, kept_sums = sums.prefix
    fixed = fixed_sums[stop] - fixed_sums[first]
    grads = grad_sums[stop] - grad_sums[first]
    kept = micro_batch_size * (kept_sums[stop] - kept_sums[first])
    peak = micro_batch_size * max(sums.transient[first:stop])
    if recompute:
        runs = range(first, stop, every or stop - first)
        inputs = len(runs) - (first == 0)  # the model's first layer receives tokens
        kept = micro_batch_size * sums.received * inputs
        peak += micro_batch_size * max(
            kept_sums[min(start + runs.step, stop)] - kept_sums[start] for start in runs
        )
    during = max(before * kept, grads + after * kept)
    tail = 2 * grads if reduce_copy else grads
    return _StageBytes(
        fixed=fixed, kept=kept, grads=grads, during=during, transient=peak, tail=tail, held=held
    )


def _least_parts(
    sums: LayerBytes,
    layers: range,
    *,
    before: int,
    after: int,
    micro_batch_size: int,
    reduce_copy: bool,
    recompute_runs: Sequence[int],
    held: int,
) -> _StageBytes:
    """A stage's parts, each the least of any recompute choice (none, or runs of each of
    `recompute_runs` layers): a rank's bytes grow with every part, so these bound its peak
    from below whichever stages a search recomputes."""
    options = [
        _stage_bytes(
            sums,
            layers,
            before=before,
            after=after,
            micro_batch_size=micro_batch_size,
            recompute=recompute,
            every=every,
            reduce_copy=reduce_copy,
            held=held,
        )
        for recompute, every in [(False, 0), *((True, every) for every in recompute_runs)]
    ]
    none = options[0]
    return _StageBytes(
        fixed=none.fixed,
        kept=min(o.kept for o in options),
        grads=none.grads,
        during=min(o.during for o in options),
        transient=min(o.transient for o in options),
        tail=none.tail,
        held=none.held,
    )


def stage_floor(
    sums: LayerBytes,
    layers: range,
    *,
    micro_batch_size: int,
    reduce_copy: bool,
    recompute_runs: Sequence[int],
    several: bool,
) -> int:
    """The least peak the stage reaches under any schedule and recompute choice, so a
    candidate is over the budget before a schedule is built: one micro-batch in flight before
    its gradients exist and, with `several` micro-batches, one again after (the next
    forward), nothing sent held. A rank holds at least each of its stages."""
    return _least_parts(
        sums,
        layers,
        before=1,
        after=int(several),
        micro_batch_size=micro_batch_size,
        reduce_copy=reduce_copy,
        recompute_runs=recompute_runs,
        held=0,
    ).peak


def rank_floor(
    sums: LayerBytes,
    schedule: Schedule,
    counts: StageCounts,
    boundaries: Sequence[int],
    *,
    micro_batch_size: int,
    reduce_copy: bool,
    recompute_runs: Sequence[int],
) -> int:
    """A bound from below of the highest rank's peak under any recompute choice. Given counts
    at most the schedule's own (those of fewer micro-batches, `SearchContext.floor_pipeline`),
    it bounds the longer step's peak without that step's schedule built."""
    parts = [
        _least_parts(
            sums,
            range(boundaries[s], boundaries[s + 1]),
            before=counts.before[s],
            after=counts.after[s],
            micro_batch_size=micro_batch_size,
            reduce_copy=reduce_copy,
            recompute_runs=recompute_runs,
            held=_held(sums, schedule, counts, s, micro_batch_size),
        )
        for s in range(schedule.num_stages)
    ]
    return max(_per_rank(parts, schedule, counts))


def _per_rank(
    parts: Sequence[_StageBytes], schedule: Schedule, counts: StageCounts
) -> tuple[int, ...]:
    """Each rank's peak from its stages' parts, at the states they reach together."""
    together = counts.together or (None,) * schedule.num_ranks
    return tuple(
        _rank_bytes([parts[s] for s in schedule.stages_of(r)], together[r])
        for r in range(schedule.num_ranks)
    )


def _in_flight(counts: StageCounts, stage: int) -> int:
    """The most micro-batches whose output the stage has sent and whose gradient is to come."""
    return max(counts.before[stage], counts.after[stage])


def _sends(schedule: Schedule, stage: int, to: int) -> bool:
    """Whether `stage` sends to the stage `to` over the network (a neighbour on the same rank,
    as at the V's turn, is handed what crosses in memory)."""
    return 0 <= to < schedule.num_stages and schedule.rank_of(to) != schedule.rank_of(stage)


def _held(
    sums: LayerBytes, schedule: Schedule, counts: StageCounts, stage: int, micro_batch_size: int
) -> int:
    """The sends a stage holds at once: input gradients sent back and not yet proved
    delivered, outputs sent forward whose gradients are to come."""
    forward = _in_flight(counts, stage) * _sends(schedule, stage, stage + 1)
    return micro_batch_size * sums.received * (counts.sent_back[stage] + forward)


def rank_peaks(
    sums: LayerBytes,
    schedule: Schedule,
    counts: StageCounts,
    boundaries: Sequence[int],
    *,
    micro_batch_size: int,
    recomputed: Sequence[bool],
    reduce_copy: bool,
    every: int = 0,
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(per stage, per rank) peak bytes; `reduce_copy`: the DP all-reduce's flat copies.

    Sends are whole hidden states, as the replay counts them under tensor parallelism too.
    An output sent forward is kept until its gradient arrives, an input gradient sent back
    until the schedule proves it delivered, as the runtime's exchange keeps them
    (`engine.schedule.delivery`): the most of each held at once (counted whole: a bound). A
    rank of several stages holds their states, stashes and sends together and one transient
    at a time.
    """
    parts = tuple(
        _stage_bytes(
            sums,
            range(boundaries[s], boundaries[s + 1]),
            before=counts.before[s],
            after=counts.after[s],
            micro_batch_size=micro_batch_size,
            recompute=recomputed[s],
            every=every,
            reduce_copy=reduce_copy,
            held=_held(sums, schedule, counts, s, micro_batch_size),
        )
        for s in range(schedule.num_stages)
    )
    return tuple(p.peak for p in parts), _per_rank(parts, schedule, counts)
