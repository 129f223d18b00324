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

from engine.schedule.actions import Action, ActionKind
from engine.schedule.passes import as_lowered, counterpart, peer_of
from engine.schedule.schedule import Schedule

__all__ = ["held_input_gradients", "released_at"]

_SENDS = (ActionKind.SEND_F, ActionKind.SEND_B)
_COMM_IDS = frozenset(map(id, (*_SENDS, ActionKind.RECV_F, ActionKind.RECV_B)))
"""By identity: an enum member's hash runs Python code, too slow over a planner's schedules."""
_F, _W = ActionKind.F, ActionKind.W


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


@functools.lru_cache(maxsize=64)
def held_input_gradients(schedule: Schedule) -> tuple[int, ...]:
    """Per stage, the most input gradients it has sent back and not yet known delivered at
    once: what its exchange holds at worst under `released_at`.

    Worked out on the compute actions alone (a receive sits right before the action that
    consumes it, a send right after the one that produced it, as `add_communication` places
    them), without lowering or hashing actions: the planner asks it of hundreds of schedules
    of tens of thousands of actions. `released_at` walks the lowered rows themselves: a user's
    lowered schedule may post its receives anywhere. Tested equal on every generator's.
    """
    rows = [[a for a in row if id(a.kind) not in _COMM_IDS] for row in schedule.rows]
    position, sends = _messages(rows, schedule)
    place, m = schedule.placement, _micro_batches(rows)
    most = [0] * schedule.num_stages
    for rank, row in enumerate(rows):
        held, freed = [0] * schedule.num_stages, dict[int, list[int]]()
        for i, a in enumerate(row):
            for stage in freed.pop(i, ()):
                held[stage] -= 1
            if a.kind is _F or a.kind is _W or a.stage == 0 or place[a.stage - 1] == rank:
                continue
            peer = place[a.stage - 1]
            held[a.stage] += 1
            most[a.stage] = max(most[a.stage], held[a.stage])
            positions, consumers = sends[peer].get(rank, ([], []))
            arrived = position[(2 * a.stage - 1) * m + a.micro_batch]  # the peer's backward
            after = bisect.bisect_left(positions, arrived)
            if after < len(positions) and position[consumers[after]] > i:
                freed.setdefault(position[consumers[after]], []).append(a.stage)
    return tuple(most)


def _micro_batches(rows: Sequence[Sequence[Action]]) -> int:
    return 1 + max((a.micro_batch for row in rows for a in row), default=0)


def _messages(
    rows: Sequence[Sequence[Action]], schedule: Schedule
) -> tuple[list[int], list[dict[int, tuple[list[int], list[int]]]]]:
    """Of compute-only rows: where in its rank's row each action sits, by (stage, whether a
    backward, micro-batch) numbered `(2 · stage + backward) · m + micro-batch` (W left out:
    it sends nothing); and per rank, per rank it sends to, after which of its actions each
    message goes and the action that consumes it there."""
    place, m = schedule.placement, _micro_batches(rows)
    position = [0] * (2 * schedule.num_stages * m)
    sends: list[dict[int, tuple[list[int], list[int]]]] = []
    for rank, row in enumerate(rows):
        by_peer: dict[int, tuple[list[int], list[int]]] = {}
        for i, a in enumerate(row):
            if a.kind is _W:
                continue
            back = a.kind is not _F
            position[(2 * a.stage + back) * m + a.micro_batch] = i
            to = a.stage - 1 if back else a.stage + 1
            if 0 <= to < len(place) and place[to] != rank:
                positions, consumers = by_peer.setdefault(place[to], ([], []))
                positions.append(i)
                consumers.append((2 * to + back) * m + a.micro_batch)
        sends.append(by_peer)
    return position, sends
