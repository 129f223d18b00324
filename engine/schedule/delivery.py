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

import functools

from engine.schedule.actions import Action, ActionKind
from engine.schedule.passes import as_lowered, counterpart, peer_of
from engine.schedule.schedule import Schedule

__all__ = ["held_input_gradients", "released_at"]

_SENDS = (ActionKind.SEND_F, ActionKind.SEND_B)


@functools.lru_cache(maxsize=64)
def released_at(schedule: Schedule, rank: int) -> dict[Action, tuple[Action, ...]]:
    """For each receive of rank `rank`'s lowered row (`as_lowered`), the sends of that row it
    proves delivered."""
    schedule = as_lowered(schedule)
    row = schedule.rows[rank]
    position = _index(row)
    releases: dict[Action, list[Action]] = {}
    for i, action in enumerate(row):
        proof: Action | None
        if action.kind is ActionKind.SEND_F:
            proof = Action(action.stage, ActionKind.RECV_B, action.micro_batch)
        elif action.kind is ActionKind.SEND_B:
            proof = _answer_after(schedule, action)
        else:
            continue
        if proof is not None and position.get(proof, -1) > i:
            releases.setdefault(proof, []).append(action)
    return {recv: tuple(sends) for recv, sends in releases.items()}


def _answer_after(schedule: Schedule, send: Action) -> Action | None:
    """The receive, on `send`'s rank, of the first message its peer sends back to it after
    receiving `send`; None if the peer sends it nothing more this step."""
    rank, peer = schedule.rank_of(send.stage), peer_of(send, schedule)
    peer_row = schedule.rows[peer]
    start = _index(peer_row)[counterpart(send)]
    for action in peer_row[start + 1 :]:
        if action.kind in _SENDS and peer_of(action, schedule) == rank:
            return counterpart(action)
    return None


@functools.lru_cache(maxsize=256)
def _index(row: tuple[Action, ...]) -> dict[Action, int]:
    return {action: i for i, action in enumerate(row)}


@functools.lru_cache(maxsize=64)
def held_input_gradients(schedule: Schedule) -> tuple[int, ...]:
    """Per stage, the most input gradients it has sent back and not yet known delivered at
    once: what its exchange holds at worst (`released_at`)."""
    schedule = as_lowered(schedule)
    most = [0] * schedule.num_stages
    for rank in range(schedule.num_ranks):
        releases = released_at(schedule, rank)
        held = [0] * schedule.num_stages
        for action in schedule.rows[rank]:
            if action.kind is ActionKind.SEND_B:
                held[action.stage] += 1
                most[action.stage] = max(most[action.stage], held[action.stage])
            for sent in releases.get(action, ()):
                held[sent.stage] -= sent.kind is ActionKind.SEND_B
    return tuple(most)
