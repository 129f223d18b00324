"""Pure lowering passes: schedule in, schedule out.

Generators describe only compute; `add_communication` spells out every activation and gradient
exchange as SEND/RECV actions, so the runtime is a plain interpreter that never has to infer
what to send where. A SEND names the sending stage, a RECV the receiving one: `SEND_F(s, k)`
matches `RECV_F(s + 1, k)` and `SEND_B(s, k)` matches `RECV_B(s - 1, k)`.
"""

from __future__ import annotations

from dataclasses import replace

from engine.actions import COMM_KINDS, Action, ActionKind
from engine.schedules import Schedule

__all__ = [
    "add_communication",
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


def peer_stage(action: Action) -> int:
    """The stage on the other end of a SEND/RECV."""
    if action.kind not in _PEER_OFFSET:
        raise ValueError(f"{action} is a compute action: only SEND/RECV actions have a peer")
    return action.stage + _PEER_OFFSET[action.kind]


def peer_of(action: Action, schedule: Schedule) -> int:
    """The rank on the other end of a SEND/RECV."""
    return schedule.rank_of(peer_stage(action))


def counterpart(action: Action) -> Action:
    """The action on the peer that completes this exchange (`0SEND_F1` ↔ `1RECV_F1`)."""
    return Action(peer_stage(action), _COUNTERPART_KIND[action.kind], action.micro_batch)


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
