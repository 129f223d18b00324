"""The V schedules' rows as arrays (`engine.schedule.generated_arrays`): V-Half's and V-Min's
block every 6 slots with their W's served from two queues, ZB-V's and DualPipeV's phases as
tokens, each action the next micro-batch of its stage and kind (a backward, B or I, the next
backward of its stage). Tested equal to `engine.schedule.v_schedules`' rows."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from engine.schedule.arrays import B, F, FlatArrays, I, W
from engine.schedule.v_schedules import PERIOD, Block, v_half_block, v_min_block

__all__ = ["dualpipe_v_arrays", "v_half_arrays", "v_min_arrays", "zb_v_arrays"]


def _served(ready: np.ndarray) -> np.ndarray:
    """Of a queue served once per slot, oldest first: how many served by the end of each slot,
    given how many have arrived by each (`ready`, never falling). Each slot serves one if one
    waits: S_i = min(S_{i-1} + 1, ready_i), which unrolls to i + min(0, min_{j<=i} ready_j - j)."""
    i = np.arange(1, len(ready) + 1)
    return i + np.minimum(0, np.minimum.accumulate(ready - i))


def _block_rank(rank: int, p: int, m: int, block: Block) -> tuple[np.ndarray, ...]:
    """`v_schedules._block_row` of one rank as (kind, stage, micro-batch) in row order: the
    block's four actions every 6 slots; each free slot runs the oldest W waiting, the up
    stage's first (two queues, `_served`); the W's left at the end, up's then down's."""
    down, up = rank, 2 * p - 1 - rank
    k = np.arange(m)
    slots = (np.asarray(block)[:, None] + PERIOD * k).ravel()
    kind = np.repeat(np.array([F, F, I, I], np.int8), m)
    stage = np.repeat(np.array([down, up, up, down]), m)
    micro_batch = np.tile(k, 4)
    end = int(slots.max()) + 1  # the last block's last action: the W's left run after it
    free = np.ones(end, dtype=bool)
    free[slots] = False
    found = [(slots, kind, stage, micro_batch)]
    open_slots = np.flatnonzero(free)
    for queue, i_slot in ((up, block[2]), (down, block[3])):
        ready = np.clip(-(-(open_slots - i_slot) // PERIOD), 0, m)  # its I's before each slot
        served = _served(ready)
        took = np.diff(served, prepend=0) > 0
        done = int(served[-1]) if len(served) else 0
        left = np.arange(done, m)
        at = np.concatenate([open_slots[took], end + m * (queue == down) + left])
        found.append(
            (
                at,
                np.full(len(at), W, np.int8),
                np.full(len(at), queue),
                np.concatenate([served[took] - 1, left]),
            )
        )
        open_slots = open_slots[~took]
    at, kind, stage, micro_batch = (np.concatenate(parts) for parts in zip(*found, strict=True))
    order = np.argsort(at, kind="stable")
    return kind[order], stage[order], micro_batch[order]


def _flat(rows: list[tuple[np.ndarray, ...]]) -> FlatArrays:
    """Each rank's (kind, stage, micro-batch) row, rank after rank, as one set of arrays."""
    kind, stage, micro_batch = (np.concatenate(parts) for parts in zip(*rows, strict=True))
    lengths = np.array([len(row[0]) for row in rows], dtype=np.int64)
    return FlatArrays.of_rows(kind, stage, micro_batch, lengths)


def _blocks(p: int, m: int, block_of: Callable[[int, int], Block]) -> FlatArrays:
    return _flat([_block_rank(r, p, m, block_of(p, r)) for r in range(p)])


def v_half_arrays(p: int, m: int, v: int) -> FlatArrays:
    return _blocks(p, m, v_half_block)


def v_min_arrays(p: int, m: int, v: int) -> FlatArrays:
    return _blocks(p, m, v_min_block)


_ZB_V_KINDS = np.array([F, I, W, F, I, W], np.int8)
"""ZB-V's six tokens: F, I and W of the rank's down stage (0-2), then of its up stage (3-5)."""


def _zb_v_rank(rank: int, p: int, m: int) -> tuple[np.ndarray, ...]:
    """`v_schedules._zb_v_row` as its phases' tokens (each action the next micro-batch of its
    stage and kind): the warm-up fills the V, each up F runs its I and W at once, the steady
    state runs F I W on both stages (the down F's stop at n), then the drain's I's and W's."""
    n = max(m, 2 * p - 1)
    down_forwards = 2 * p - rank - 1  # after the warm-up: the up stage has run p
    phases = [
        ([0], 2 * (p - rank) - 1),
        ([3, 0], rank),
        ([3, 4, 5], p - rank),
        ([0, 1, 2, 3, 4, 5], n - down_forwards),  # until the down F's reach n
        ([1, 2, 3, 4, 5], p - rank - 1),  # until the up F's catch up
        ([1, 4], rank),
        ([1, 2], p - rank),
        ([5], rank),
        ([2], rank),
    ]
    tokens = np.concatenate([np.tile(np.array(t), times) for t, times in phases])
    micro_batch = np.zeros(len(tokens), dtype=np.int64)
    for token in range(6):
        mine = tokens == token
        micro_batch[mine] = np.arange(int(mine.sum()))
    keep = micro_batch < m  # n > m: the extra micro-batches are dropped
    stage = np.where(tokens < 3, rank, 2 * p - 1 - rank)
    return _ZB_V_KINDS[tokens][keep], stage[keep], micro_batch[keep]


def zb_v_arrays(p: int, m: int, v: int) -> FlatArrays:
    return _flat([_zb_v_rank(r, p, m) for r in range(p)])


_DUALPIPE_KINDS = np.array([F, F, B, B, I, I, W], np.int8)
"""DualPipeV's tokens: F of the down and up stage (0, 1), a fused backward of each (2, 3),
a split one (4, 5), and a slot for the oldest W waiting, if any (6)."""

_DUALPIPE_COUNTERS = np.array([0, 1, 2, 3, 2, 3, -1])
"""Whose next micro-batch each token is: the stage's F's (0, 1) or its backwards, B or I
(2, 3); a W is its split backward's."""


def _dualpipe_v_tokens(rank: int, p: int, m: int) -> np.ndarray:
    """`v_schedules._dualpipe_v_row`'s eight phases as tokens (`_DUALPIPE_KINDS`)."""
    drain = []
    split = False
    for i in range(rank + 1):  # phase 6: one of the pairs starts splitting, the rest stay split
        split = split or (i == (rank + 1) // 2 and rank % 2 == 1)
        drain.append(5 if split else 3)
        split = split or (i == (rank + 1) // 2 and rank % 2 == 0)
        drain.append(4 if split else 2)
    warm, rest = p - rank - 1, m - 2 * p + rank + 1
    phases = [
        ([0], 2 * warm),
        ([0, 1], rank + 1),
        ([5, 6, 1], warm),
        ([0, 3, 1, 2], rest),
        ([3, 1, 2], warm),
        (drain, 1),
        ([6, 4], warm),
    ]
    return np.concatenate([np.tile(np.array(t, dtype=np.int64), k) for t, k in phases])


def _dualpipe_v_rank(rank: int, p: int, m: int) -> tuple[np.ndarray, ...]:
    """A DualPipeV row: each F the next micro-batch of its stage, each backward (B or I) the
    next backward of its stage; each W slot runs the oldest split backward's W waiting
    (`_served`), and the W's left run at the end."""
    tokens = _dualpipe_v_tokens(rank, p, m)
    stage = np.where(tokens % 2 == 0, rank, 2 * p - 1 - rank)
    counted = _DUALPIPE_COUNTERS[tokens]
    micro_batch = np.zeros(len(tokens), dtype=np.int64)
    for counter in range(4):
        mine = counted == counter
        micro_batch[mine] = np.arange(int(mine.sum()))
    slot = tokens == 6
    split = (tokens == 4) | (tokens == 5)
    splits = np.flatnonzero(split)
    served = _served(np.cumsum(split)[slot])  # the split backwards before each W slot
    took = np.diff(served, prepend=0) > 0
    taken = served[took] - 1
    at = np.flatnonzero(slot)[took]
    left = np.arange(int(served[-1]) if len(served) else 0, len(splits))
    order = np.concatenate([np.flatnonzero(~slot), at, len(tokens) + left])
    w = splits[np.concatenate([taken, left])]
    kinds = np.concatenate([_DUALPIPE_KINDS[tokens[~slot]], np.full(len(w), W, np.int8)])
    stages = np.concatenate([stage[~slot], stage[w]])
    micro_batches = np.concatenate([micro_batch[~slot], micro_batch[w]])
    by = np.argsort(order, kind="stable")
    return kinds[by], stages[by], micro_batches[by]


def dualpipe_v_arrays(p: int, m: int, v: int) -> FlatArrays:
    return _flat([_dualpipe_v_rank(r, p, m) for r in range(p)])
