"""Per-rank memory of a candidate layout, fast enough to screen thousands of them.

The terms are the memory model's own, per layer (`engine.plan.layer_bytes`: each distinct
layer traced once on fake tensors, its model states from its parameter shapes). A stage
holds its states, then, as `engine.memory.fitting.stage_bytes` composes them, its in-flight
stashes (the schedule's counts, `engine.plan.counts`) or its gradients with the stashes still
held once they exist, plus the highest transient (of fused backwards, less what the computing
micro-batch's later layers no longer hold). Under full recompute a stage keeps only its
input per micro-batch and regenerates one micro-batch's activations during each backward. A
rank holds the sum of its stages. `meshpipe memory --plan FILE` replays the chosen plan
exactly.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from engine.memory.states import DP_BUCKET_BYTES
from engine.plan.counts import StageCounts
from engine.plan.layer_bytes import LayerBytes
from engine.schedule.arrays import rank_stages

__all__ = ["highest_stage_floor", "rank_floor", "rank_peaks"]


@dataclass(frozen=True)
class _Parts:
    """Every stage's peak in parts, one array entry per stage, so that a rank of several
    stages counts each part as its stages hold it together: states and stashes add up, one
    micro-batch's transients do not (a rank computes one action at a time). Arrays: the
    screen composes thousands of candidates of up to a hundred stages."""

    fixed: np.ndarray
    kept: np.ndarray
    """One micro-batch's stash."""
    fused_kept: np.ndarray
    """One micro-batch's stash before a fused B, where the stage's others are split."""
    waiting_w: np.ndarray
    """What one split micro-batch holds from its I to its W."""
    grads: np.ndarray
    during: np.ndarray
    """The step's stashes and gradients, without the transient."""
    transient: np.ndarray
    tail: np.ndarray
    """The gradient reduction's buffers after the step: under ZeRO-0 with replicas the
    gradients and the flat bucket being made beside them (`BucketedAllReduce.start`)."""
    held: np.ndarray

    @property
    def peak(self) -> np.ndarray:
        return self.fixed + np.maximum(self.during + self.transient, self.tail) + self.held


def _stage_parts(
    sums: LayerBytes,
    boundaries: Sequence[int],
    *,
    before: np.ndarray,
    after: np.ndarray,
    micro_batch_size: int,
    recomputed: np.ndarray,
    every: int,
    reduce_copy: bool,
    held: np.ndarray,
    fused: np.ndarray | None = None,
    awaiting: tuple[np.ndarray, np.ndarray] | None = None,
    warm: np.ndarray | None = None,
) -> _Parts:
    """Each stage's peak: states, then the larger of its step and its gradient reduction,
    plus `held`, the sends kept to the step's end (counted whole: a bound). Stages
    `fused` keep what a fused backward needs (`LayerBytes.fused_kept`). Where
    `recomputed`, in runs of `every` layers (0: the whole stage), a forward keeps each run's
    input and a backward regenerates one run's activations at a time."""
    arrays = sums.arrays
    bounds = np.asarray(boundaries, dtype=np.int64)
    first, stop = bounds[:-1], bounds[1:]
    grads = arrays.grad_sums[stop] - arrays.grad_sums[first]
    shared = micro_batch_size * _shared_per_stage(sums, first, stop)
    kept = micro_batch_size * (arrays.kept_sums[stop] - arrays.kept_sums[first]) + shared
    transient = micro_batch_size * np.maximum.reduceat(arrays.transient, first)
    fused_kept = micro_batch_size * (arrays.fused_sums[stop] - arrays.fused_sums[first]) + shared
    waiting_w = micro_batch_size * (arrays.awaiting_sums[stop] - arrays.awaiting_sums[first])
    if fused is not None and fused.any():
        fused_transient = micro_batch_size * np.maximum.reduceat(arrays.fused_transient, first)
        later = micro_batch_size * _past_later_layers(sums, first, stop)
        kept = np.where(fused, fused_kept, kept)
        transient = np.where(fused, fused_transient, transient)
        transient = np.where(fused & ~recomputed, later, transient)
    if recomputed.any():
        runs = _runs(first, stop, every)
        # each run keeps its input: the first as the stage received it (the model's first
        # layer receives tokens), the later ones from the stage's fp32 residual stream
        inputs = sums.received * (first != 0) + sums.residual * (runs - 1)
        kept = np.where(recomputed, micro_batch_size * inputs, kept)
        fused_kept = np.where(recomputed, kept, fused_kept)
        # A recomputing stage runs its whole backward at I (`PipelineStage.backward_input`):
        # nothing of a micro-batch waits for its (empty) W.
        waiting_w = np.where(recomputed, 0, waiting_w)
        regenerated = micro_batch_size * _regenerated(sums, first, stop, every, fused)
        transient = np.where(recomputed, regenerated, transient)
    transient += np.maximum.reduceat(arrays.turn, first)  # a layer's turn lives as it computes
    stashed = after * kept
    if awaiting is not None:
        before_i, before_w = awaiting
        stashed = (before_i * kept[:, None] + before_w * waiting_w[:, None]).max(axis=1)
    during = np.maximum(before * kept, grads + stashed)
    if sums.gradients_first:  # held beside the warm-up's stashes too (`warm`: else `before`)
        during = grads + np.maximum((before if warm is None else warm) * kept, stashed)
    return _Parts(
        fixed=arrays.fixed_sums[stop] - arrays.fixed_sums[first],
        kept=kept,
        fused_kept=fused_kept,
        waiting_w=waiting_w,
        grads=grads,
        during=during,
        transient=transient,
        tail=grads + np.minimum(grads, DP_BUCKET_BYTES) if reduce_copy else grads,
        held=held,
    )


def _shared_per_stage(sums: LayerBytes, first: np.ndarray, stop: np.ndarray) -> np.ndarray:
    """Per stage, what its layers' stashes (`LayerBytes.kept`: each layer traced alone, less
    the input it received) count twice of one sequence: each hidden state between two of its
    layers, which the one before counts as its output sent (in the compute dtype) and the
    next, less its received input, as that input widened to fp32, where the stage holds one
    fp32 copy. Measured: n blocks of llama-tiny or gpt-tiny traced together keep n of one
    traced alone less n - 1 fp32 hidden states, in bf16 and fp32 alike. So under autocast
    each boundary inside a stage counts the received size less; in fp32, nothing."""
    return (sums.received - sums.residual) * (stop - first - 1)


def _past_later_layers(sums: LayerBytes, first: np.ndarray, stop: np.ndarray) -> np.ndarray:
    """Per stage of fused backwards, its highest transient of one sequence over what its
    stash (counted whole, with the micro-batch computing) overstates then: while a layer
    runs its forward or backward, the same micro-batch's later layers of the stage hold
    nothing (not yet run, or already freed by their backward). Layer j's transient less
    those layers' fused stash, boundaries inside them less (`_shared_per_stage`). The
    embedding's backward, last in its micro-batch, so no longer rides on the whole stash:
    llama3-70b pp8's rank 0 read 9.8 % over the replay."""
    arrays = sums.arrays
    sizes = stop - first
    ends = np.repeat(stop, sizes)
    layer = np.arange(int(first[0]), int(stop[-1]))
    later = arrays.fused_sums[ends] - arrays.fused_sums[layer + 1]
    later += (ends - 1 - layer) * (sums.received - sums.residual)
    less = arrays.fused_transient[layer] - np.maximum(later, 0)
    return np.maximum.reduceat(less, first - first[0])


def _regenerated(
    sums: LayerBytes, first: np.ndarray, stop: np.ndarray, every: int, fused: np.ndarray | None
) -> np.ndarray:
    """Per recomputing stage, its highest transient of one sequence with a run regenerated:
    while layer j runs its backward, its run holds the regenerated layers up to j (the later
    ones have run theirs and freed them), so layer j's transient rides on that part of the run,
    not on all of it (in `every`-layer runs, 0: the whole stage), its inner boundaries counted
    once (`_shared_per_stage`)."""
    arrays = sums.arrays
    sizes = stop - first
    layer = np.arange(int(first[0]), int(stop[-1]))
    starts = np.repeat(first, sizes)
    if every:
        starts = starts + (layer - starts) // every * every
    held = arrays.kept_sums[layer + 1] - arrays.kept_sums[starts]
    held += (layer - starts) * (sums.received - sums.residual)  # `_shared_per_stage`
    each = arrays.transient[layer]
    if fused is not None:
        each = np.where(np.repeat(fused, sizes), arrays.fused_transient[layer], each)
    return np.maximum.reduceat(held + each, first - first[0])


def _runs(first: np.ndarray, stop: np.ndarray, every: int) -> np.ndarray:
    """Per stage, how many recompute runs of `every` layers it has (0: one run)."""
    if every == 0:
        return np.ones_like(first)
    return -(-(stop - first) // every)


def _choices(stages: int, recompute_runs: Sequence[int]) -> list[tuple[np.ndarray, int]]:
    """The recompute choices a search tries for a rank's stages, as (stages recomputed, run
    length): none, or all of them in runs of each of `recompute_runs` layers. The screen's
    `fit` recomputes a rank's stages together, so any rank's peak is one of these."""
    none = np.zeros(stages, dtype=bool)
    return [(none, 0), *((~none, every) for every in recompute_runs)]


def highest_stage_floor(
    sums: LayerBytes,
    boundaries: Sequence[int],
    *,
    micro_batch_size: int,
    reduce_copy: bool,
    recompute_runs: Sequence[int],
    several: bool,
) -> int:
    """The least peak the highest stage reaches under any schedule and recompute choice, so
    a candidate is over the budget before a schedule is built: one micro-batch in flight
    before its gradients exist and, with `several` micro-batches, one again after (the next
    forward), nothing sent held. A rank holds at least each of its stages."""
    stages = len(boundaries) - 1
    peaks = [
        _stage_parts(
            sums.least,
            boundaries,
            before=np.ones(stages, dtype=np.int64),
            after=np.full(stages, int(several), dtype=np.int64),
            micro_batch_size=micro_batch_size,
            recomputed=recomputed,
            every=every,
            reduce_copy=reduce_copy,
            held=np.zeros(stages, dtype=np.int64),
            fused=np.ones(stages, dtype=bool),
        ).peak
        for recomputed, every in _choices(stages, recompute_runs)
    ]
    return int(np.minimum.reduce(peaks).max())


def rank_floor(
    sums: LayerBytes,
    placement: tuple[int, ...],
    counts: StageCounts,
    boundaries: Sequence[int],
    *,
    micro_batch_size: int,
    reduce_copy: bool,
    recompute_runs: Sequence[int],
) -> int:
    """A bound from below of the highest rank's peak under any recompute choice (each rank's
    least over `_choices`). Given counts at most the schedule's own (those of fewer
    micro-batches, `SearchContext.floor_pipeline`), it bounds the longer step's peak without
    that step's schedule built."""
    held = _held(sums, placement, counts, micro_batch_size)
    per_rank = [
        _per_rank(
            _stage_parts(
                sums.least,
                boundaries,
                before=np.asarray(counts.before, dtype=np.int64),
                after=np.asarray(counts.after, dtype=np.int64),
                micro_batch_size=micro_batch_size,
                recomputed=recomputed,
                every=every,
                reduce_copy=reduce_copy,
                held=held,
                fused=np.ones(len(placement), dtype=bool),
            ),
            placement,
            counts,
            gradients_first=sums.gradients_first,
        )
        for recomputed, every in _choices(len(placement), recompute_runs)
    ]
    return max(min(peaks) for peaks in zip(*per_rank, strict=True))


def _per_rank(
    parts: _Parts, placement: tuple[int, ...], counts: StageCounts, *, gradients_first: bool
) -> tuple[int, ...]:
    """Each rank's peak from its stages' parts, at the states they reach together (without
    them, each stage's most in flight) and the largest transient; the gradients in every
    state where they exist from the step's start (`LayerBytes.gradients_first`)."""
    mine = rank_stages(placement)
    if mine.shape[1] == 1:
        return tuple(parts.peak[mine[:, 0]].tolist())
    states = _stacked(placement, counts.together or (None,) * mine.shape[0])
    grads = np.zeros_like(parts.grads) if gradients_first else parts.grads
    each = (parts.waiting_w, parts.kept, parts.fused_kept, grads)  # `counts.State`
    bytes_per = np.concatenate([part[mine] for part in each], axis=1)[:, None, :]
    reached = (states.states * bytes_per).sum(axis=2).max(axis=1)
    if gradients_first:
        reached = reached + parts.grads[mine].sum(axis=1)
    stashes = np.where(states.known, reached, parts.during[mine].sum(axis=1))
    top = np.maximum(stashes + parts.transient[mine].max(axis=1), parts.tail[mine].sum(axis=1))
    return tuple(((parts.fixed + parts.held)[mine].sum(axis=1) + top).tolist())


@dataclass(frozen=True)
class _Stacked:
    """Each rank's states together (`StageCounts.together`) as one array, (rank, state,
    `counts.State`'s four columns per stage), a rank's first state repeated to the longest list;
    `known` where a rank has them."""

    states: np.ndarray
    known: np.ndarray


@functools.lru_cache(maxsize=1024)
def _stacked(
    placement: tuple[int, ...], together: tuple[frozenset[tuple[int, ...]] | None, ...]
) -> _Stacked:
    k = rank_stages(placement).shape[1]
    rows = [sorted(states) if states else [(0,) * 4 * k] for states in together]
    longest = max(len(row) for row in rows)
    padded = [row + [row[0]] * (longest - len(row)) for row in rows]
    known = np.array([states is not None for states in together])
    return _Stacked(
        states=np.array(padded, dtype=np.int64).reshape(len(rows), longest, 4 * k), known=known
    )


def _held(
    sums: LayerBytes, placement: tuple[int, ...], counts: StageCounts, micro_batch_size: int
) -> np.ndarray:
    """The sends each stage holds at once: input gradients sent back and not yet proved
    delivered, outputs sent forward (over the network: a neighbour on the same rank, as at
    the V's turn, is handed what crosses in memory) whose gradients are to come."""
    place = np.asarray(placement)
    forward = np.append(place[1:] != place[:-1], False)
    in_flight = np.maximum(counts.before, counts.after)
    sent_back = np.asarray(counts.sent_back, dtype=np.int64)
    return micro_batch_size * sums.received * (sent_back + in_flight * forward)


def rank_peaks(
    sums: LayerBytes,
    placement: tuple[int, ...],
    counts: StageCounts,
    boundaries: Sequence[int],
    *,
    micro_batch_size: int,
    recomputed: Sequence[bool],
    reduce_copy: bool,
    every: int = 0,
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(per stage, per rank) peak bytes; `reduce_copy`: the DP all-reduce's flat bucket.

    Sends are whole hidden states, as the replay counts them under tensor parallelism too.
    An output sent forward is kept until its gradient arrives, an input gradient sent back
    until the schedule proves it delivered, as the runtime's exchange keeps them
    (`engine.schedule.delivery`): the most of each held at once (counted whole: a bound). A
    rank of several stages holds their states, stashes and sends together and one transient
    at a time.
    """
    parts = _stage_parts(
        sums,
        boundaries,
        before=np.asarray(counts.before, dtype=np.int64),
        after=np.asarray(counts.after, dtype=np.int64),
        micro_batch_size=micro_batch_size,
        recomputed=np.asarray(recomputed, dtype=bool),
        every=every,
        reduce_copy=reduce_copy,
        held=_held(sums, placement, counts, micro_batch_size),
        fused=np.asarray(counts.fused, dtype=bool) if counts.fused else None,
        awaiting=_awaiting_arrays(counts.awaiting) if counts.awaiting else None,
        warm=np.asarray(counts.warm, dtype=np.int64) if counts.warm else None,
    )
    peaks = _per_rank(parts, placement, counts, gradients_first=sums.gradients_first)
    return tuple(parts.peak.tolist()), peaks


@functools.lru_cache(maxsize=1024)
def _awaiting_arrays(
    awaiting: tuple[tuple[tuple[int, int], ...], ...],
) -> tuple[np.ndarray, np.ndarray]:
    """`StageCounts.awaiting` as two (stage, state) arrays, each stage's first state repeated
    to the longest list."""
    longest = max(len(pairs) for pairs in awaiting)
    padded = np.array([[*pairs, *[pairs[0]] * (longest - len(pairs))] for pairs in awaiting])
    return padded[:, :, 0].astype(np.int64), padded[:, :, 1].astype(np.int64)
