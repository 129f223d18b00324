"""Pure lowering passes: schedule in, schedule out.

Generators describe only compute; `add_communication` spells out every activation and gradient
exchange as SEND/RECV actions, so the runtime is a plain interpreter that never has to infer
what to send where. A SEND names the sending stage, a RECV the receiving one: `SEND_F(s, k)`
matches `RECV_F(s + 1, k)` and `SEND_B(s, k)` matches `RECV_B(s - 1, k)`.
"""

from __future__ import annotations

import functools
from dataclasses import replace

from engine.schedule.actions import COMM_KINDS, Action, ActionKind
from engine.schedule.schedule import Schedule

__all__ = [
    "add_communication",
    "as_lowered",
    "communication_for",
    "counterpart",
    "forward_only",
    "is_lowered",
    "peer_of",
    "peer_stage",
]

_PEER_OFFSET = {
    ActionKind.SEND_F: +1,
    ActionKind.RECV_F: -1,
    ActionKind.SEND_B: -1,
    ActionKind.RECV_B: +1,
}
_COUNTERPART_KIND = {
    ActionKind.SEND_F: ActionKind.RECV_F,
    ActionKind.RECV_F: ActionKind.SEND_F,
    ActionKind.SEND_B: ActionKind.RECV_B,
    ActionKind.RECV_B: ActionKind.SEND_B,
}


def is_lowered(schedule: Schedule) -> bool:
    """Whether the schedule already spells out its communication."""
    return schedule.lowered or any(a.kind in COMM_KINDS for row in schedule.rows for a in row)


def peer_stage(action: Action, num_stages: int | None = None) -> int:
    """The stage on the other end of a SEND/RECV.

    Without `num_stages` it is arithmetic alone and may fall outside the schedule (-1 for stage
    0's RECV_F), which the validator reports as a problem with the schedule; with it, a SEND/RECV
    whose peer stage does not exist is a ValueError.
    """
    if action.kind not in _PEER_OFFSET:
        raise ValueError(f"{action} is a compute action: only SEND/RECV actions have a peer")
    peer = action.stage + _PEER_OFFSET[action.kind]
    if num_stages is not None and not 0 <= peer < num_stages:
        raise _no_peer(action, peer, f"0..{num_stages - 1}")
    return peer


def peer_of(action: Action, schedule: Schedule) -> int:
    """The rank on the other end of a SEND/RECV; ValueError if its stage has no peer that way
    (placement[-1] would otherwise answer for stage 0's RECV_F with the last rank)."""
    return schedule.rank_of(peer_stage(action, schedule.num_stages))


def counterpart(action: Action, num_stages: int | None = None) -> Action:
    """The action on the peer that completes this exchange (`0SEND_F1` ↔ `1RECV_F1`).

    ValueError if the peer stage is below 0, or with `num_stages` outside the schedule: there
    is no action that could complete the exchange.
    """
    peer = peer_stage(action, num_stages)
    if peer < 0:
        raise _no_peer(action, peer, "numbered from 0")
    return Action(peer, _COUNTERPART_KIND[action.kind], action.micro_batch)


def _no_peer(action: Action, peer: int, stages: str) -> ValueError:
    side = "previous" if peer < action.stage else "next"
    return ValueError(
        f"{action} has no peer: stage {action.stage} has no {side} stage {peer} (stages are "
        f"{stages}); the first stage's input and the last stage's output never cross ranks, "
        "so drop the action"
    )


def communication_for(action: Action, schedule: Schedule) -> tuple[list[Action], list[Action]]:
    """The receives that go right before a compute action and the sends right after it.

    The one statement of what crosses ranks: lowering inserts these, the validator demands them.
    """
    stage, k = action.stage, action.micro_batch
    if not 0 <= stage < schedule.num_stages:
        return [], []  # the validator reports it; lowering leaves it as it is
    rank = schedule.rank_of(stage)
    prev_remote = stage > 0 and schedule.rank_of(stage - 1) != rank
    next_remote = stage < schedule.num_stages - 1 and schedule.rank_of(stage + 1) != rank
    before: list[Action] = []
    after: list[Action] = []
    if action.kind is ActionKind.F:
        if prev_remote:
            before.append(Action(stage, ActionKind.RECV_F, k))
        if next_remote:
            after.append(Action(stage, ActionKind.SEND_F, k))
    elif action.kind in (ActionKind.B, ActionKind.I):
        if next_remote:
            before.append(Action(stage, ActionKind.RECV_B, k))
        if prev_remote:
            after.append(Action(stage, ActionKind.SEND_B, k))
    return before, after


def add_communication(schedule: Schedule) -> Schedule:
    """A copy with a RECV right before and a SEND right after each action that crosses ranks.

    F receives activations from the previous stage and sends to the next; B (or I) receives the
    gradient from the next stage and sends to the previous; W stays local. Stages on the same
    rank pass data in memory, so they get no communication.
    """
    if is_lowered(schedule):
        raise ValueError(
            f"schedule {schedule.name!r} is already lowered: add_communication takes the "
            "compute-only schedule a generator returns"
        )
    rows = []
    for row in schedule.rows:
        lowered: list[Action] = []
        for action in row:
            before, after = communication_for(action, schedule)
            lowered += [*before, action, *after]
        rows.append(tuple(lowered))
    return replace(schedule, rows=tuple(rows), lowered=True)


@functools.lru_cache(maxsize=64)
def as_lowered(schedule: Schedule) -> Schedule:
    """The schedule with its communication spelled out (itself if it already is)."""
    return schedule if is_lowered(schedule) else add_communication(schedule)


def forward_only(schedule: Schedule) -> Schedule:
    """The compute-only schedule without its backward actions: the same placement and forward
    order, so `eval_step` runs every stage a training step runs (virtual stages included).

    Dropping actions keeps every remaining dependency and each rank's order, so a schedule
    without deadlock stays without deadlock.
    """
    if is_lowered(schedule):
        raise ValueError("forward_only takes the compute-only schedule a generator returns")
    rows = tuple(tuple(a for a in row if a.kind is ActionKind.F) for row in schedule.rows)
    return replace(schedule, name=f"{schedule.name}-forward", rows=rows)
