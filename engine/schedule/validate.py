"""Schedule validator.

`validate` checks the invariants every schedule must keep (each micro-batch's F, B or I+W once,
in order, on the rank that holds its stage; every send matched by one receive) and reports all
broken ones at once; `engine.simulate` then runs what passed.
"""

from __future__ import annotations

from collections import Counter

from engine.schedule.actions import COMM_KINDS, Action, ActionKind
from engine.schedule.passes import (
    communication_for,
    counterpart,
    is_lowered,
    peer_stage,
)
from engine.schedule.schedule import Schedule

__all__ = ["ScheduleError", "validate"]

_F, _B, _I, _W = ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W
_USES = {  # the compute kinds a communication action feeds or is fed by
    ActionKind.SEND_F: (_F,),
    ActionKind.RECV_F: (_F,),
    ActionKind.SEND_B: (_B, _I),
    ActionKind.RECV_B: (_B, _I),
}
_RECVS = frozenset({ActionKind.RECV_F, ActionKind.RECV_B})
_ORDER_GROUPS = {_F: ("F",), _B: ("B/I", "B/W"), _I: ("B/I",), _W: ("B/W",)}
"""Per kind, the sequences it belongs to on a stage, each in ascending micro-batch order. B/W
are the actions that accumulate weight gradients: in the reference's micro-batch order."""


class ScheduleError(ValueError):
    """A schedule that breaks an invariant or deadlocks; the message lists every problem."""


# --- validation ---------------------------------------------------------------------------------


def _placement_problem(schedule: Schedule, rank: int, action: Action) -> str | None:
    """Why an action cannot run on `rank`, or None."""
    s, k, last = action.stage, action.micro_batch, schedule.num_stages - 1
    if not 0 <= s <= last:
        return f"stage {s} is outside 0..{last}"
    if not 0 <= k < schedule.micro_batches:
        return f"micro-batch {k} is outside 0..{schedule.micro_batches - 1}"
    if schedule.rank_of(s) != rank:
        return f"stage {s} lives on rank {schedule.rank_of(s)}"
    if action.kind in COMM_KINDS:
        peer = peer_stage(action)
        if not 0 <= peer <= last:
            return f"stage {s} has no stage {peer} to exchange with"
        if schedule.rank_of(peer) == rank:
            return f"stages {s} and {peer} share rank {rank} and pass data in memory"
    return None


def _check_placement(schedule: Schedule) -> tuple[list[str], list[list[tuple[int, Action]]]]:
    """Problems with where actions sit, and each rank's well-placed actions with their index."""
    problems: list[str] = []
    placed: list[list[tuple[int, Action]]] = []
    for rank, row in enumerate(schedule.rows):
        placed.append([])
        for index, action in enumerate(row):
            why = _placement_problem(schedule, rank, action)
            if why is None:
                placed[rank].append((index, action))
            else:
                problems.append(f"rank {rank}: {action} at index {index}: {why}")
    return problems, placed


def _check_counts(schedule: Schedule, placed: list[list[tuple[int, Action]]]) -> list[str]:
    """Each (stage, micro-batch) has one F and either one B or one I and one W.

    A forward-only schedule (no backward action at all, as `inference` makes) needs only F's.
    """
    seen = Counter(a for row in placed for _, a in row)
    forward_only = all(a.kind is _F for a in seen if a.is_compute)
    problems = []
    for s in range(schedule.num_stages):
        for k in range(schedule.micro_batches):
            f, b, i, w = (seen[Action(s, kind, k)] for kind in (_F, _B, _I, _W))
            if f != 1:
                problems.append(
                    f"stage {s} micro-batch {k}: expected exactly one {s}F{k}, found {f}"
                )
            if (b, i, w) not in ((1, 0, 0), (0, 1, 1)) and not forward_only:
                problems.append(
                    f"stage {s} micro-batch {k}: expected one {s}B{k}, or one {s}I{k} and one "
                    f"{s}W{k}; found B×{b}, I×{i}, W×{w}"
                )
    return problems


def _check_rank_order(rank: int, row: list[tuple[int, Action]]) -> list[str]:
    """On one rank: F before its B/I, I before its W, each stage's kinds in micro-batch order."""
    first = _first_index(row)
    problems = []
    last: dict[tuple[int, str], Action] = {}
    for index, action in row:
        s, k = action.stage, action.micro_batch
        needs = {_B: _F, _I: _F, _W: _I}.get(action.kind)
        if needs is not None and first.get(Action(s, needs, k), -1) > index:
            before = Action(s, needs, k)
            problems.append(
                f"rank {rank}: {action} at index {index} comes before its {before} "
                f"at index {first[before]}"
            )
        for group in _ORDER_GROUPS.get(action.kind, ()):
            prev = last.get((s, group))
            if prev is not None and k < prev.micro_batch:
                problems.append(
                    f"rank {rank}: {action} at index {index} comes after {prev}: stage {s}'s "
                    f"{group} actions must run in ascending micro-batch order"
                )
            last[(s, group)] = action
    return problems


def _comm_order_problem(action: Action, index: int, first: dict[Action, int]) -> str | None:
    """A send must follow the compute action that produces its data, a receive precede its user."""
    users = [Action(action.stage, kind, action.micro_batch) for kind in _USES[action.kind]]
    found = [(first[u], u) for u in users if u in first]
    if not found:
        return f"has no {' or '.join(map(str, users))} on its rank"
    at, user = min(found)
    if action.kind in _RECVS and at < index:
        return f"comes after {user} at index {at}: a receive must come before its use"
    if action.kind not in _RECVS and at > index:
        return f"comes before {user} at index {at}: a send must come after what it sends"
    return None


def _first_index(row: list[tuple[int, Action]]) -> dict[Action, int]:
    first: dict[Action, int] = {}
    for index, action in row:
        first.setdefault(action, index)
    return first


def _missing_comm(schedule: Schedule, action: Action, first: dict[Action, int]) -> list[str]:
    """The sends/receives a compute action needs (see `communication_for`) that are absent."""
    before, after = communication_for(action, schedule)
    return [f"needs {c} before it, none found" for c in before if c not in first] + [
        f"needs {c} after it, none found" for c in after if c not in first
    ]


def _exchange_problems(
    schedule: Schedule,
    rank: int,
    index: int,
    first: dict[Action, int],
    on_rank: list[Counter[Action]],
) -> list[str]:
    """A SEND/RECV must be unique, matched on its peer rank, and in order with its compute."""
    action = schedule.rows[rank][index]
    problems = []
    count = on_rank[rank][action]
    if count > 1 and first[action] == index:
        problems.append(f"appears {count} times: each exchange happens once")
    match = counterpart(action)
    peer = schedule.rank_of(match.stage)
    if on_rank[peer][match] == 0:
        problems.append(f"has no matching {match} on rank {peer}")
    order = _comm_order_problem(action, index, first)
    if order is not None:
        problems.append(order)
    return problems


def _check_comm(schedule: Schedule, placed: list[list[tuple[int, Action]]]) -> list[str]:
    """Every SEND has one matching RECV on the peer (and back), in order with its compute."""
    on_rank = [Counter(a for _, a in row) for row in placed]
    problems = []
    for rank, row in enumerate(placed):
        first = _first_index(row)
        for index, action in row:
            if action.kind in COMM_KINDS:
                whys = _exchange_problems(schedule, rank, index, first, on_rank)
            else:
                whys = _missing_comm(schedule, action, first)
            problems += [f"rank {rank}: {action} at index {index} {why}" for why in whys]
    return problems


def validate(schedule: Schedule) -> None:
    """Raise `ScheduleError` listing every broken invariant; works lowered or compute-only."""
    problems, placed = _check_placement(schedule)
    problems += _check_counts(schedule, placed)
    for rank, row in enumerate(placed):
        problems += _check_rank_order(rank, row)
    if is_lowered(schedule):
        problems += _check_comm(schedule, placed)
    if problems:
        raise ScheduleError(
            f"schedule {schedule.name!r} breaks {len(problems)} rule(s):\n  "
            + "\n  ".join(problems)
        )
