"""When a rank knows a send of a lowered schedule was delivered, so it may free what it sent.

A posted send's buffer lives until the rank waits on it, and waiting early can stall on a
peer that has not reached the matching receive yet. The schedule says when the wait is free:
once a receive arrives that the peer could only have posted after it received the send.
- An output sent forward (SEND_F) is delivered once its gradient comes back (RECV_B of the
  same stage and micro-batch): the peer computed from it.
- An input gradient sent back (SEND_B) is delivered once a message arrives from the same peer
  that the peer sends after its matching RECV_B (each rank runs its row in order). Without
  this, a stage keeps every micro-batch's input gradient to the step's end: m boundary
  tensors, which a V rank's returning chunk sends and 1F1B's first rank never does.
Sends with no such later message are waited on at the step's end. The runtime's exchange, the
memory replay and the planner's bound all read `released_at`.
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from engine.schedule.actions import Action, ActionKind
from engine.schedule.arrays import B, F, FlatArrays, I, W, flat_arrays, running_sums
from engine.schedule.passes import as_lowered, counterpart, peer_of
from engine.schedule.schedule import Schedule

__all__ = ["held_in", "held_input_gradients", "released_at"]

_Key = tuple[int, ActionKind, int]
"""An action as a plain (stage, kind, micro-batch) tuple: equal to the `Action`, and as a
dictionary key found by it."""


def released_at(schedule: Schedule, rank: int) -> dict[Action, tuple[Action, ...]]:
    """For each receive of rank `rank`'s lowered row (`as_lowered`), the sends of that row it
    proves delivered."""
    return _releases(as_lowered(schedule))[rank]


@functools.lru_cache(maxsize=64)
def _releases(schedule: Schedule) -> tuple[dict[Action, tuple[Action, ...]], ...]:
    """`released_at` of every rank of a lowered schedule, from one index of each row.

    Looked up by plain (stage, kind, micro-batch) tuples, which hash and compare as the
    actions do: a 405b plan's lowered schedule has some 230,000 actions, and making an
    `Action` for each lookup was much of the time (0.28 → 0.16 s for V-Min at pp 64)."""
    index: list[dict[_Key, int]] = [
        {action: i for i, action in enumerate(row)} for row in schedule.rows
    ]
    sends = _sends_to(schedule)
    place = schedule.placement
    send_f, send_b, recv_b = ActionKind.SEND_F, ActionKind.SEND_B, ActionKind.RECV_B
    every = []
    for rank, row in enumerate(schedule.rows):
        mine = index[rank]
        releases: dict[Action, list[Action]] = {}
        for i, action in enumerate(row):
            stage, kind, k = action
            if kind is send_f:
                at = mine.get((stage, recv_b, k), -1)
            elif kind is send_b:
                # the first message its peer sends back to it after receiving it
                peer = place[stage - 1] if stage > 0 else peer_of(action, schedule)  # raises
                positions, answers = sends[peer].get(rank, ((), ()))
                after = bisect.bisect(positions, index[peer][(stage - 1, recv_b, k)])
                at = mine.get(answers[after], -1) if after < len(answers) else -1
            else:
                continue
            if at > i:
                releases.setdefault(row[at], []).append(action)
        every.append({recv: tuple(sends) for recv, sends in releases.items()})
    return tuple(every)


def _sends_to(
    schedule: Schedule,
) -> list[dict[int, tuple[list[int], list[_Key]]]]:
    """Per rank, per rank it sends to: where in its row each send is, and the receive that
    takes it (as a (stage, kind, micro-batch) tuple)."""
    found: list[dict[int, tuple[list[int], list[_Key]]]] = []
    place, last = schedule.placement, schedule.num_stages - 1
    send_f, send_b = ActionKind.SEND_F, ActionKind.SEND_B
    recv_f, recv_b = ActionKind.RECV_F, ActionKind.RECV_B
    for row in schedule.rows:
        by_peer: dict[int, tuple[list[int], list[_Key]]] = {}
        for i, (stage, kind, k) in enumerate(row):
            if kind is not send_f and kind is not send_b:
                continue
            if kind is send_f and stage < last:
                peer, answer = place[stage + 1], (stage + 1, recv_f, k)
            elif kind is send_b and stage > 0:
                peer, answer = place[stage - 1], (stage - 1, recv_b, k)
            else:
                peer, answer = peer_of(row[i], schedule), counterpart(row[i])  # raises
            if peer not in by_peer:
                by_peer[peer] = ([], [])
            positions, answers = by_peer[peer]
            positions.append(i)
            answers.append(answer)
        found.append(by_peer)
    return found


def held_input_gradients(schedule: Schedule) -> tuple[int, ...]:
    """Per stage, the most input gradients it has sent back and not yet known delivered at
    once: what its exchange holds at worst under `released_at`.

    Worked out on the compute actions alone (a receive sits right before the action that
    consumes it, a send right after the one that produced it, as `add_communication` places
    them), as arrays (`held_in`): the planner asks it of hundreds of schedules of tens of
    thousands of actions. `released_at` walks the lowered rows themselves: a user's lowered
    schedule may post its receives anywhere. Tested equal on every generator's.
    """
    return held_in(flat_arrays(schedule), schedule.placement)


def held_in(flat: FlatArrays, placement: Sequence[int]) -> tuple[int, ...]:
    """`held_input_gradients` of compute rows already read into arrays, every rank at once:
    each send back counts from its backward until the receive that proves it delivered (a
    later message from the peer, sent after the peer's backward consumed it), or to the
    step's end."""
    place = np.asarray(placement, dtype=np.int64)
    most = np.zeros(len(place), dtype=np.int64)
    if not len(flat.kind):
        return tuple(most.tolist())
    m = 1 + int(flat.micro_batch.max())
    position, messages = _messages(flat, place, m)
    peer = place[np.maximum(flat.stage - 1, 0)]
    backward = (flat.kind == B) | (flat.kind == I)
    sent = np.flatnonzero(backward & (flat.stage > 0) & (peer != flat.rank))
    stage, at = flat.stage[sent], flat.position[sent]
    arrived = position[(2 * stage - 1) * m + flat.micro_batch[sent]]  # the peer's backward
    freed = messages.first_after(peer[sent], flat.rank[sent], arrived, position)
    freed[freed <= at] = -1  # only a receive after the send proves it delivered
    known = freed >= 0
    # a receive frees before its position's action runs: frees at 2j, sends at 2i + 1
    times = np.concatenate([2 * at + 1, 2 * freed[known]])
    steps = np.concatenate([np.ones(len(at), np.int64), -np.ones(int(known.sum()), np.int64)])
    stages = np.concatenate([stage, stage[known]])
    order = np.lexsort((times, stages))
    stages, steps = stages[order], steps[order]
    if len(stages):
        starts = np.flatnonzero(np.diff(stages, prepend=-1))
        held = running_sums(steps, starts)
        most[stages[starts]] = np.maximum(np.maximum.reduceat(held, starts), 0)
    return tuple(most.tolist())


@dataclass(frozen=True, eq=False)
class _Messages:
    """The messages sent to another rank, ordered by (sender, receiver) then by the
    sender's position: `pair` = sender · ranks + receiver, `at` the sender's position,
    `consumer` the number of the action that takes it (as `_messages` numbers them)."""

    pair: np.ndarray
    at: np.ndarray
    consumer: np.ndarray
    ranks: int
    longest: int

    def first_after(
        self, sender: np.ndarray, receiver: np.ndarray, at: np.ndarray, position: np.ndarray
    ) -> np.ndarray:
        """Where in its receiver's row the first message `sender` sends it at or after
        position `at` is taken; -1 where none is."""
        keys = self.pair * self.longest + self.at
        wanted = sender * self.ranks + receiver
        found = np.searchsorted(keys, wanted * self.longest + at, side="left")
        inside = found < len(keys)
        hit = np.zeros(len(found), dtype=bool)
        hit[inside] = self.pair[found[inside]] == wanted[inside]
        freed = np.full(len(found), -1, dtype=np.int64)
        freed[hit] = position[self.consumer[found[hit]]]
        return freed


def _messages(flat: FlatArrays, place: np.ndarray, m: int) -> tuple[np.ndarray, _Messages]:
    """Where in its rank's row each action sits, by (stage, whether a backward, micro-batch)
    numbered `(2 · stage + backward) · m + micro-batch` (W left out: it sends nothing); and
    the messages that cross ranks (`_Messages`)."""
    back = (flat.kind != F).astype(np.int64)
    sends_something = flat.kind != W
    number = (2 * flat.stage + back) * m + flat.micro_batch
    position = np.zeros(2 * len(place) * m, dtype=np.int64)
    position[number[sends_something]] = flat.position[sends_something]
    to = np.where(back == 1, flat.stage - 1, flat.stage + 1)
    inside = sends_something & (to >= 0) & (to < len(place))
    dest = np.full(len(to), -1)
    dest[inside] = place[to[inside]]
    away = np.flatnonzero(inside & (dest != flat.rank))
    ranks = len(flat.starts) - 1
    pair = flat.rank[away] * ranks + dest[away]
    order = np.argsort(pair, kind="stable")  # rows are in order: positions stay sorted
    consumer = ((2 * to + back) * m + flat.micro_batch)[away]
    return position, _Messages(
        pair=pair[order],
        at=flat.position[away][order],
        consumer=consumer[order],
        ranks=ranks,
        longest=1 + int(flat.position.max()),
    )
