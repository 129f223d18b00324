"""The generators' schedules as arrays, without their actions: what the planner reads.

A search counts and compiles hundreds of schedules of up to a hundred thousand actions, and
making each `Action` and reading it back into arrays (`flat_arrays`) was most of that work.
GPipe, 1F1B, the ZB-H family and the loop-placed virtual schedules place every action by a
formula of its rank, its unit and the rank's warm-up; V-Half and V-Min by their block, their
W's served from two queues; ZB-V and DualPipeV run phases of repeated patterns, each action
the next micro-batch of its stage and kind. So their arrays are written directly, a few array
operations per schedule or per rank. The generators (`engine.schedule.generators`,
`engine.schedule.v_schedules`) stay what every run executes; these arrays are tested equal to
theirs (tests/unit/test_generated_arrays.py).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from engine.schedule.arrays import B, F, FlatArrays, I, ScheduleArrays, W, read_arrays
from engine.schedule.generated_v_arrays import (
    dualpipe_v_arrays,
    v_half_arrays,
    v_min_arrays,
    zb_v_arrays,
)
from engine.schedule.generators import VIRTUAL_SCHEDULES, make_schedule, own_placement
from engine.schedule.v_schedules import V_SCHEDULES

__all__ = ["ARRAY_GENERATORS", "schedule_arrays"]


class _Rows:
    """Every rank's row at once, padded to the longest (-1 where a row has ended)."""

    def __init__(self, num_ranks: int, length: int) -> None:
        self.kind = np.full((num_ranks, length), -1, dtype=np.int8)
        self.stage = np.zeros((num_ranks, length), dtype=np.int64)
        self.micro_batch = np.zeros((num_ranks, length), dtype=np.int64)
        self._rank = np.arange(num_ranks)[:, None]

    def put(
        self,
        at: np.ndarray,
        kind: int | np.ndarray,
        stage: int | np.ndarray,
        micro_batch: int | np.ndarray,
    ) -> None:
        """Actions at positions `at` (one row of positions per rank; -1: none there)."""
        rank = np.broadcast_to(self._rank, at.shape)
        keep = at >= 0
        rows, cols = rank[keep], at[keep]
        self.kind[rows, cols] = np.broadcast_to(kind, at.shape)[keep]
        self.stage[rows, cols] = np.broadcast_to(stage, at.shape)[keep]
        self.micro_batch[rows, cols] = np.broadcast_to(micro_batch, at.shape)[keep]

    def flat(self) -> FlatArrays:
        held = self.kind >= 0
        return FlatArrays.of_rows(
            self.kind[held], self.stage[held], self.micro_batch[held], held.sum(axis=1)
        )


def _paired(warmup: np.ndarray, units: int) -> tuple[np.ndarray, np.ndarray]:
    """Positions of each rank's forward and backward of unit i in a row of `warmup[r]`
    forwards, then forward/backward pairs, then the remaining backwards (1F1B's shape)."""
    i = np.arange(units)[None, :]
    w = warmup[:, None]
    forward = np.where(i < w, i, 2 * i - w)
    backward = np.where(i < units - w, w + 2 * i + 1, units + i)
    return forward, backward


def _one_f_one_b(
    num_ranks: int, micro_batches: int, warmup: np.ndarray, split: np.ndarray | None = None
) -> FlatArrays:
    """1F1B's rows with `warmup[r]` forwards on rank r; with `split`, rank r's last
    `split[r]` micro-batches run I instead of B and their W's come last
    (`generators._one_f_one_b_row`)."""
    m = micro_batches
    tail = np.zeros(num_ranks, dtype=np.int64) if split is None else split
    rows = _Rows(num_ranks, 2 * m + int(tail.max(initial=0)))
    forward, backward = _paired(warmup, m)
    stage = np.arange(num_ranks)[:, None]
    k = np.arange(m)[None, :]
    first_split = (m - tail)[:, None]
    rows.put(forward, F, stage, k)
    rows.put(backward, np.where(k >= first_split, I, B), stage, k)
    rows.put(np.where(k >= first_split, m + k + tail[:, None], -1), W, stage, k)
    return rows.flat()


def _gpipe(p: int, m: int, v: int) -> FlatArrays:
    return _one_f_one_b(p, m, np.full(p, m))


def _1f1b(p: int, m: int, v: int) -> FlatArrays:
    return _one_f_one_b(p, m, np.minimum(p - 1 - np.arange(p), m))


def _zb_drain(p: int, m: int, v: int) -> FlatArrays:
    r = np.arange(p)
    return _one_f_one_b(p, m, np.minimum(2 * (p - 1 - r), m), np.minimum(3 * r, m))


def _zero_bubble(num_ranks: int, m: int, warmup: np.ndarray, lag: np.ndarray) -> FlatArrays:
    """`generators._zero_bubble_row` of every rank: F/I pairs after the warm-up, each W `lag`
    pairs late, the cool-down's I's each followed by a W, the W's left last; a rank of no
    lag runs 1F1B with fused B's."""
    rows = _Rows(num_ranks, 3 * m)
    k = np.arange(m)[None, :]
    w, lag = np.minimum(warmup, m)[:, None], lag[:, None]
    steady = m - w
    j = k - w  # the steady pair a forward runs in
    forward = np.where(k < w, k, w + 2 * j + np.maximum(0, j - lag))
    drained = w + 2 * steady + np.maximum(0, steady - lag)  # where the cool-down starts
    early = np.maximum(0, steady - lag)  # W's run in the steady pairs
    i_at = np.where(k < steady, w + 2 * k + np.maximum(0, k - lag) + 1, drained + 2 * (k - steady))
    w_at = np.where(
        k < early,
        w + 3 * k + 2 * lag + 2,
        np.where(k < early + w, drained + 2 * (k - early) + 1, drained + w + k - early),
    )
    fused = lag == 0
    plain_forward, plain_backward = _paired(w[:, 0], m)
    stage = np.arange(num_ranks)[:, None]
    rows.put(np.where(fused, plain_forward, forward), F, stage, k)
    rows.put(np.where(fused, plain_backward, i_at), np.where(fused, B, I), stage, k)
    rows.put(np.where(fused, -1, w_at), W, stage, k)
    return rows.flat()


def _zb_h1(p: int, m: int, v: int) -> FlatArrays:
    r = np.arange(p)
    return _zero_bubble(p, m, p - 1 - r, r)


def _zb_h2(p: int, m: int, v: int) -> FlatArrays:
    r = np.arange(p)
    return _zero_bubble(p, m, 2 * (p - 1 - r), 2 * r)


def _interleaved(p: int, m: int, v: int) -> FlatArrays:
    """Megatron's units (`generators.interleaved_1f1b`): unit i is micro-batch
    group·P + offset of chunk c, forwards ascending through the chunks, backwards
    descending; 1F1B's shape over m·v units."""
    units = m * v
    r = np.arange(p)
    warmup = np.full(p, units) if m == p else np.minimum(units, 2 * (p - r - 1) + (v - 1) * p)
    group, at = np.divmod(np.arange(units), p * v)
    chunk, offset = np.divmod(at, p)
    micro_batch = (group * p + offset)[None, :]
    rows = _Rows(p, 2 * units)
    forward, backward = _paired(warmup, units)
    rows.put(forward, F, chunk[None, :] * p + r[:, None], micro_batch)
    rows.put(backward, B, (v - 1 - chunk)[None, :] * p + r[:, None], micro_batch)
    return rows.flat()


def _looped_bfs(p: int, m: int, v: int) -> FlatArrays:
    """Every micro-batch through each chunk in turn, forwards up the chunks, backwards down."""
    units = m * v
    chunk, micro_batch = np.divmod(np.arange(units), m)
    r = np.arange(p)[:, None]
    rows = _Rows(p, 2 * units)
    at = np.broadcast_to(np.arange(units), (p, units))
    rows.put(at, F, chunk[None, :] * p + r, micro_batch[None, :])
    rows.put(at + units, B, (v - 1 - chunk)[None, :] * p + r, micro_batch[None, :])
    return rows.flat()


ARRAY_GENERATORS: dict[str, Callable[[int, int, int], FlatArrays]] = {
    "gpipe": _gpipe,
    "1f1b": _1f1b,
    "zb_h1": _zb_h1,
    "zb_h2": _zb_h2,
    "zb_drain": _zb_drain,
    "interleaved_1f1b": _interleaved,
    "looped_bfs": _looped_bfs,
    "v_half": v_half_arrays,
    "v_min": v_min_arrays,
    "zb_v": zb_v_arrays,
    "dualpipe_v": dualpipe_v_arrays,
}
"""Each generator's rows written as arrays (`schedule_arrays`), by the generator's name."""


def schedule_arrays(
    name: str, num_ranks: int, micro_batches: int, stages_per_rank: int
) -> ScheduleArrays:
    """`make_schedule(name, ...)`'s compute rows as arrays, written without its actions
    (`ARRAY_GENERATORS`). A name or sizes the generators refuse go to `make_schedule`, whose
    error names the fix."""
    p, m, v = num_ranks, micro_batches, stages_per_rank
    write = ARRAY_GENERATORS.get(name)
    if write is None or not _writable(name, p, m, v):
        return read_arrays(make_schedule(name, num_ranks=p, micro_batches=m, stages_per_rank=v))
    return ScheduleArrays(write(p, m, v), own_placement(name, p, v), m)


def _writable(name: str, p: int, m: int, v: int) -> bool:
    """Sizes the generator accepts (`make_schedule` explains the others)."""
    if p < 1 or m < 1:
        return False
    if name in V_SCHEDULES:
        return v == 2 and (name != "dualpipe_v" or m >= 2 * p)
    if name not in VIRTUAL_SCHEDULES:
        return v == 1
    return v >= 2 and (name != "interleaved_1f1b" or m % p == 0)
