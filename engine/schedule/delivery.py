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

import numpy as np

from engine.schedule.actions import Action, ActionKind
from engine.schedule.arrays import B, F, I, RowArrays, W, compute_arrays
from engine.schedule.passes import as_lowered, counterpart, peer_of
from engine.schedule.schedule import Schedule

__all__ = ["held_in", "held_input_gradients", "released_at"]

_SENDS = (ActionKind.SEND_F, ActionKind.SEND_B)


def released_at(schedule: Schedule, rank: int) -> dict[Action, tuple[Action, ...]]:
    """For each receive of rank `rank`'s lowered row (`as_lowered`), the sends of that row it
    proves delivered."""
    return _releases(as_lowered(schedule))[rank]


@functools.lru_cache(maxsize=64)
def _releases(schedule: Schedule) -> tuple[dict[Action, tuple[Action, ...]], ...]:
    """`released_at` of every rank of a lowered schedule, from one index of each row."""
    index = [{action: i for i, action in enumerate(row)} for row in schedule.rows]
    sends = _sends_to(schedule)
    every = []
    for rank, row in enumerate(schedule.rows):
        releases: dict[Action, list[Action]] = {}
        for i, action in enumerate(row):
            proof: Action | None = None
            if action.kind is ActionKind.SEND_F:
                proof = Action(action.stage, ActionKind.RECV_B, action.micro_batch)
            elif action.kind is ActionKind.SEND_B:
                # the first message its peer sends back to it after receiving it
                peer = peer_of(action, schedule)
                positions, answers = sends[peer].get(rank, ((), ()))
                after = bisect.bisect(positions, index[peer][counterpart(action)])
                proof = answers[after] if after < len(answers) else None
            if proof is not None and index[rank].get(proof, -1) > i:
                releases.setdefault(proof, []).append(action)
        every.append({recv: tuple(sends) for recv, sends in releases.items()})
    return tuple(every)


def _sends_to(schedule: Schedule) -> list[dict[int, tuple[list[int], list[Action]]]]:
    """Per rank, per rank it sends to: where in its row each send is, and the receive that
    takes it."""
    found: list[dict[int, tuple[list[int], list[Action]]]] = []
    for row in schedule.rows:
        by_peer: dict[int, tuple[list[int], list[Action]]] = {}
        for i, action in enumerate(row):
            if action.kind in _SENDS:
                positions, answers = by_peer.setdefault(peer_of(action, schedule), ([], []))
                positions.append(i)
                answers.append(counterpart(action))
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
    return held_in(compute_arrays(schedule), schedule.placement)


def held_in(rows: Sequence[RowArrays], placement: Sequence[int]) -> tuple[int, ...]:
    """`held_input_gradients` of compute rows already read into arrays: each send back counts
    from its backward until the receive that proves it delivered (a later message from the
    peer, sent after the peer's backward consumed it), or to the step's end."""
    place = np.asarray(placement, dtype=np.int64)
    m = 1 + max((int(row.micro_batch.max()) for row in rows if len(row)), default=0)
    position, sends = _messages(rows, place, m)
    most = [0] * len(place)
    for rank, row in enumerate(rows):
        peer = place[np.maximum(row.stage - 1, 0)]
        backward = (row.kind == B) | (row.kind == I)
        sent = np.flatnonzero(backward & (row.stage > 0) & (peer != rank))
        stage, to = row.stage[sent], peer[sent]
        arrived = position[(2 * stage - 1) * m + row.micro_batch[sent]]  # the peer's backward
        freed = np.full(len(sent), -1)
        for p in np.unique(to):
            positions, consumers = sends[int(p)].get(rank, (_NONE, _NONE))
            ours = to == p
            after = np.searchsorted(positions, arrived[ours], side="left")
            known = after < len(positions)
            at = np.full(len(after), -1)
            at[known] = position[consumers[after[known]]]
            freed[ours] = at
        freed[freed <= sent] = -1  # only a receive after the send proves it delivered
        for s in np.unique(stage):
            mine = stage == s
            # a receive frees before its position's action runs: frees at 2j, sends at 2i+1
            times = np.concatenate([2 * sent[mine] + 1, 2 * freed[mine & (freed >= 0)]])
            steps = np.where(times % 2 == 1, 1, -1)[np.argsort(times)]
            most[s] = max(most[s], int(np.cumsum(steps).max(initial=0)))
    return tuple(most)


_NONE = np.zeros(0, dtype=np.int64)


def _messages(
    rows: Sequence[RowArrays], place: np.ndarray, m: int
) -> tuple[np.ndarray, list[dict[int, tuple[np.ndarray, np.ndarray]]]]:
    """Where in its rank's row each action sits, by (stage, whether a backward, micro-batch)
    numbered `(2 · stage + backward) · m + micro-batch` (W left out: it sends nothing); and
    per rank, per rank it sends to, after which of its actions each message goes and the
    number of the action that consumes it there."""
    position = np.zeros(2 * len(place) * m, dtype=np.int64)
    sends: list[dict[int, tuple[np.ndarray, np.ndarray]]] = []
    for rank, row in enumerate(rows):
        index = np.arange(len(row))
        back = (row.kind != F).astype(np.int64)
        sends_something = row.kind != W
        position[((2 * row.stage + back) * m + row.micro_batch)[sends_something]] = index[
            sends_something
        ]
        to = np.where(back == 1, row.stage - 1, row.stage + 1)
        inside = sends_something & (to >= 0) & (to < len(place))
        dest = np.full(len(row), rank)
        dest[inside] = place[to[inside]]
        away = inside & (dest != rank)
        by_peer = {}
        for p in np.unique(dest[away]):
            k = away & (dest == p)
            by_peer[int(p)] = (index[k], (2 * to[k] + back[k]) * m + row.micro_batch[k])
        sends.append(by_peer)
    return position, sends
