"""Schedules over the V placement (two stages per rank, rank r holding stages r and 2P − 1 − r).

`zb_v` is ZB-V of the Zero Bubble paper (Qi et al., 2024): the same peak activations as 1F1B
and, with T_F = T_I = T_W and steps that follow each other without a barrier, no bubble.
`dualpipe_v` is DeepSeek's DualPipeV (DualPipe folded onto the V, as torch ships it): in its
steady state each rank pairs a forward of one stage with a backward of its other stage; the pair
runs one after the other here (the overlap of one's compute with the other's communication is
the interpreter's to give, not the order's). `v_half` and `v_min` are the memory-controllable
schedules of Qi et al., "Pipeline Parallelism with Controllable Memory" (2024): one building
block (where each rank runs a micro-batch's two forwards and two input-gradient backwards, in
unit time slots) repeated every 6 slots, its weight gradients filling the free slots; the
block's lifespan sets the peak, about 1/2 (V-Half) or 1/3 (V-Min) of 1F1B's activations, for
a bubble of about P/2m or 2P/3m.
"""

from __future__ import annotations

from collections.abc import Callable

from engine.schedule.actions import Action, ActionKind
from engine.schedule.placement import placement_of
from engine.schedule.schedule import Schedule

__all__ = ["V_SCHEDULES", "dualpipe_v", "v_half", "v_min", "zb_v"]

_F, _B, _I, _W = ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W
PERIOD = 6
"""Slots of one micro-batch on one rank: two F, two I, two W, each one slot."""


def _check(name: str, num_ranks: int, micro_batches: int) -> None:
    if num_ranks < 1:
        raise ValueError(f"{name}: num_ranks={num_ranks}: a pipeline needs at least 1 rank")
    if micro_batches < 1:
        raise ValueError(f"{name}: micro_batches={micro_batches} must be at least 1")


def _v_schedule(name: str, rows: list[list[Action]], micro_batches: int) -> Schedule:
    num_ranks = len(rows)
    return Schedule(
        name=name,
        num_ranks=num_ranks,
        num_stages=2 * num_ranks,
        micro_batches=micro_batches,
        placement=placement_of("v", num_ranks, 2),
        rows=tuple(tuple(a for a in row if a.micro_batch < micro_batches) for row in rows),
    )


class _Counters:
    """Next micro-batch of each (stage, kind) on one rank, appending actions to its row."""

    def __init__(self) -> None:
        self.row: list[Action] = []
        self.next: dict[tuple[int, ActionKind], int] = {}

    def add(self, stage: int, kind: ActionKind) -> None:
        k = self.next.get((stage, kind), 0)
        self.row.append(Action(stage, kind, k))
        self.next[(stage, kind)] = k + 1

    def count(self, stage: int, kind: ActionKind) -> int:
        return self.next.get((stage, kind), 0)


def _zb_v_row(rank: int, num_ranks: int, micro_batches: int) -> list[Action]:
    """Rank r's ZB-V row: the warm-up fills the V (2(P−r)−1 forwards of the first chunk, then r
    forward pairs), then each F of the second chunk runs its I and W at once; the steady state
    alternates F I W on both chunks; the drain runs the I's and the W's left."""
    p, n = num_ranks, max(micro_batches, 2 * num_ranks - 1)  # extra micro-batches are dropped
    down, up = rank, 2 * p - 1 - rank
    c = _Counters()
    for _ in range(2 * (p - rank) - 1):
        c.add(down, _F)
    for _ in range(rank):
        c.add(up, _F)
        c.add(down, _F)
    for _ in range(p - rank):
        for kind in (_F, _I, _W):
            c.add(up, kind)
    while c.count(up, _F) < c.count(down, _F) or c.count(down, _F) < n:
        if c.count(down, _F) < n:
            c.add(down, _F)
        for stage, kinds in ((down, (_I, _W)), (up, (_F, _I, _W))):
            for kind in kinds:
                c.add(stage, kind)
    for _ in range(rank):
        c.add(down, _I)
        c.add(up, _I)
    for _ in range(p - rank):
        c.add(down, _I)
        c.add(down, _W)
    for stage in (up, down):
        while c.count(stage, _W) < c.count(stage, _I):
            c.add(stage, _W)
    return c.row


def zb_v(num_ranks: int, micro_batches: int) -> Schedule:
    """ZB-V: two stages per rank in a V, every backward split; peak activations those of 1F1B
    (2P stage stashes, P micro-batches of the rank's share), no bubble in the steady state
    of back-to-back steps when T_F = T_I = T_W."""
    _check("zb_v", num_ranks, micro_batches)
    rows = [_zb_v_row(r, num_ranks, micro_batches) for r in range(num_ranks)]
    return _v_schedule("zb_v", rows, micro_batches)


class _DualPipeRow(_Counters):
    """A DualPipeV row: its W's wait in one queue, oldest first, whatever their stage."""

    def __init__(self, rank: int, num_ranks: int) -> None:
        super().__init__()
        self.down, self.up = rank, 2 * num_ranks - 1 - rank
        self.waiting: list[Action] = []

    def backward(self, stage: int, split: bool) -> None:
        if split:
            self.waiting.append(Action(stage, _W, self.count(stage, _I)))
            self.add(stage, _I)
            self.next[(stage, _B)] = self.count(stage, _B) + 1
        else:
            self.add(stage, _B)
            self.next[(stage, _I)] = self.count(stage, _I) + 1

    def weight(self) -> None:
        if self.waiting:
            self.row.append(self.waiting.pop(0))

    def pair(self, forward: int, backward: int) -> None:
        """DualPipe's overlapped chunk pair: a forward, then a fused backward of the other."""
        self.add(forward, _F)
        self.backward(backward, split=False)


def _dualpipe_v_row(rank: int, num_ranks: int, micro_batches: int) -> list[Action]:
    """DualPipeV's eight phases on rank r (DeepSeek-V3 report; torch's ScheduleDualPipeV)."""
    p, c = num_ranks, _DualPipeRow(rank, num_ranks)
    down, up = c.down, c.up
    for _ in range(2 * (p - rank - 1)):
        c.add(down, _F)
    for _ in range(rank + 1):
        c.add(down, _F)
        c.add(up, _F)
    for _ in range(p - rank - 1):
        c.backward(up, split=True)
        c.weight()
        c.add(up, _F)
    for _ in range(micro_batches - 2 * p + rank + 1):
        c.pair(down, up)
        c.pair(up, down)
    for _ in range(p - rank - 1):
        c.backward(up, split=False)
        c.pair(up, down)
    split = False
    for i in range(rank + 1):
        split = split or (i == (rank + 1) // 2 and rank % 2 == 1)
        c.backward(up, split)
        split = split or (i == (rank + 1) // 2 and rank % 2 == 0)
        c.backward(down, split)
    for _ in range(p - rank - 1):
        c.weight()
        c.backward(down, split=True)
    while c.waiting:
        c.weight()
    return c.row


def dualpipe_v(num_ranks: int, micro_batches: int) -> Schedule:
    """DualPipeV: forward and backward chunks of two micro-batches paired on each rank; the
    warm-up's and the drain's backwards split to fill the bubble. Needs m >= 2P."""
    _check("dualpipe_v", num_ranks, micro_batches)
    if micro_batches < 2 * num_ranks:
        raise ValueError(
            f"dualpipe_v needs at least as many micro-batches as stages (m={micro_batches}, "
            f"{2 * num_ranks} stages): use --micro-batches {2 * num_ranks} or more"
        )
    rows = [_dualpipe_v_row(r, num_ranks, micro_batches) for r in range(num_ranks)]
    return _v_schedule("dualpipe_v", rows, micro_batches)


Block = tuple[int, int, int, int]
"""A rank's slots for one micro-batch: F down, F up, I up, I down (down: stage r, up: 2P−1−r)."""


def v_min_block(num_ranks: int, rank: int) -> Block:
    """V-Min's block on `rank` (also written as arrays: `engine.schedule.generated_v_arrays`)."""
    p, gap = num_ranks, 2 if num_ranks % 3 == 0 else 0
    return rank, 2 * p - 1 - rank, 2 * p + gap + rank, 4 * p + gap - 1 - rank


def v_half_block(num_ranks: int, rank: int) -> Block:
    """V-Half's block on `rank`."""
    p, gap = num_ranks, 3 if num_ranks % 2 == 0 else 0
    return 2 * rank, 3 * p - 2 - rank, 3 * p + gap + 2 * rank - 1, 6 * p + gap - 2 - rank


def _block_row(rank: int, num_ranks: int, micro_batches: int, block: Block) -> list[Action]:
    """The block repeated every 6 slots; each free slot runs the oldest pending W (the up
    stage's first), the W's left run at the end: a rank's actions in slot order."""
    down, up = rank, 2 * num_ranks - 1 - rank
    kinds = ((down, _F), (up, _F), (up, _I), (down, _I))
    timed = {
        offset + PERIOD * k: Action(stage, kind, k)
        for (stage, kind), offset in zip(kinds, block, strict=True)
        for k in range(micro_batches)
    }
    assert len(timed) == 4 * micro_batches, f"block {block} puts two actions in one slot"
    row: list[Action] = []
    pending: dict[int, list[int]] = {up: [], down: []}
    for slot in range(max(timed) + 1):
        action = timed.get(slot)
        if action is not None:
            row.append(action)
            if action.kind is _I:
                pending[action.stage].append(action.micro_batch)
            continue
        for stage in (up, down):
            if pending[stage]:
                row.append(Action(stage, _W, pending[stage].pop(0)))
                break
    return row + [Action(s, _W, k) for s in (up, down) for k in pending[s]]


def _block_schedule(
    name: str, num_ranks: int, micro_batches: int, block: Callable[[int, int], Block]
) -> Schedule:
    _check(name, num_ranks, micro_batches)
    rows = [_block_row(r, num_ranks, micro_batches, block(num_ranks, r)) for r in range(num_ranks)]
    return _v_schedule(name, rows, micro_batches)


def v_half(num_ranks: int, micro_batches: int) -> Schedule:
    """V-Half: about half of 1F1B's peak activations ((P + 2) // 2 micro-batches of the
    rank's share on its busiest rank), for a bubble of about P/2m when T_F = T_I = T_W."""
    return _block_schedule("v_half", num_ranks, micro_batches, v_half_block)


def v_min(num_ranks: int, micro_batches: int) -> Schedule:
    """V-Min: about a third of 1F1B's peak activations ((P + 4) // 3 micro-batches of the
    rank's share), for a bubble of about 2P/3m when T_F = T_I = T_W."""
    return _block_schedule("v_min", num_ranks, micro_batches, v_min_block)


V_SCHEDULES: dict[str, Callable[[int, int], Schedule]] = {
    "zb_v": zb_v,
    "v_half": v_half,
    "v_min": v_min,
    "dualpipe_v": dualpipe_v,
}
"""Generators whose schedules hold two stages per rank in the V placement."""
