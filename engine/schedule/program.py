"""The simulator's clock alone, compiled: a schedule's rows worked out once into integers
(`Program`), then timed under many costs (`program_times`, `simulate_times`). Its ends and busy
times equal `simulate`'s to the bit; the planner prices each schedule so under hundreds of
layouts' costs, and compiles the schedules in its worker processes (`engine.plan.programs`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from engine.schedule.actions import ActionKind
from engine.schedule.arrays import B, F, I, ScheduleArrays, read_arrays
from engine.schedule.schedule import Schedule
from engine.schedule.simulate import ActionCosts, simulate

__all__ = [
    "Program",
    "SimTimes",
    "compiled_program",
    "cost_table",
    "fused_program",
    "program_times",
    "simulate_times",
]

_F, _B, _I, _W = ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W


@dataclass(frozen=True, kw_only=True)
class SimTimes:
    """What a search needs of a dry run: when each rank ends and how long it computes."""

    ends: tuple[float, ...]
    busy: tuple[float, ...]


_OPS = {
    ActionKind.SEND_F: (None, 0, 0),
    ActionKind.SEND_B: (None, 1, 0),
    ActionKind.RECV_F: (None, 0, -1),
    ActionKind.RECV_B: (None, 1, +1),
    **{kind: (index, 0, 0) for index, kind in enumerate((_F, _B, _I, _W))},
}
"""Per kind: a compute's cost index in (F, B, I, W), or a message's direction and where its
sender sits."""


_Step = tuple[int, int, int]


@dataclass(frozen=True)
class Program:
    """A schedule's rows as steps `(cost, wait, make)`: wait for message `wait` (-1: none),
    compute for cost index `cost` (stage · 4 + F/B/I/W; the last index costs 0), then post
    message `make` (-1: none). A compute-only schedule's compute, with the receive lowering
    puts before it and the send after it, is one step; a lowered row's actions are a step
    each. With the count of messages and each row's cost indices in order."""

    rows: tuple[tuple[_Step, ...], ...]
    messages: int
    computes: tuple[tuple[int, ...], ...]


@functools.lru_cache(maxsize=64)
def _program(schedule: Schedule) -> Program:
    """Worked out once per schedule, so a search pricing it under many costs walks integers,
    not actions."""
    fused = None if schedule.lowered else _fused_program(schedule)
    if fused is not None:
        return fused
    idle = 4 * schedule.num_stages
    messages: dict[tuple[int, int, int], int] = {}
    rows = []
    for row in schedule.rows:
        steps = []
        for action in row:
            index, direction, offset = _OPS[action.kind]
            if index is not None:
                steps.append((4 * action.stage + index, -1, -1))
                continue
            key = (action.stage + offset, direction, action.micro_batch)
            message = messages.setdefault(key, len(messages))
            steps.append((idle, message, -1) if offset else (idle, -1, message))
        rows.append(tuple(steps))
    return Program(rows=tuple(rows), messages=len(messages), computes=_computes(rows, idle))


def _computes(rows: Sequence[Sequence[_Step]], idle: int) -> tuple[tuple[int, ...], ...]:
    """Each row's cost indices in order: its busy time is their sum."""
    return tuple(tuple(cost for cost, _, _ in steps if cost != idle) for steps in rows)


def _fused_program(schedule: Schedule) -> Program | None:
    """The program of a compute-only schedule as lowering would make it (`fused_program`);
    None where the rows hold a send or receive, or a stage or micro-batch the schedule lacks
    (the lowered path's)."""
    arrays = read_arrays(schedule)
    m, last = schedule.micro_batches, schedule.num_stages - 1
    if any(
        len(row) != len(actions)
        or ((row.stage < 0) | (row.stage > last) | (row.micro_batch < 0)).any()
        or (row.micro_batch >= m).any()
        for row, actions in zip(arrays.rows(), schedule.rows, strict=True)
    ):
        return None
    return fused_program(arrays)


def fused_program(arrays: ScheduleArrays) -> Program:
    """The program of a compute-only schedule's rows (read into arrays, or written so:
    `engine.schedule.generated_arrays`) as lowering would make it, one step per compute
    action: a forward waits for its input from the previous stage and posts its output to
    the next where that stage is on another rank; a backward (B or I) waits for its gradient
    from the next stage and posts one to the previous. A message is numbered
    `(2 · sending stage + backward) · m + micro-batch`."""
    m, last = arrays.micro_batches, arrays.num_stages - 1
    place = np.asarray(arrays.placement, dtype=np.int64)
    rows = []
    for rank, row in enumerate(arrays.rows()):
        stage, micro_batch = row.stage, row.micro_batch
        forward = row.kind == F
        backward = (row.kind == B) | (row.kind == I)
        prev_away = (stage > 0) & (place[np.maximum(stage - 1, 0)] != rank)
        next_away = (stage < last) & (place[np.minimum(stage + 1, last)] != rank)
        wait = np.where(forward & prev_away, 2 * (stage - 1) * m + micro_batch, -1)
        wait = np.where(backward & next_away, (2 * (stage + 1) + 1) * m + micro_batch, wait)
        make = np.where(forward & next_away, 2 * stage * m + micro_batch, -1)
        make = np.where(backward & prev_away, (2 * stage + 1) * m + micro_batch, make)
        cost = 4 * stage + row.kind
        rows.append(tuple(zip(cost.tolist(), wait.tolist(), make.tolist(), strict=True)))
    idle = 4 * arrays.num_stages
    return Program(rows=tuple(rows), messages=2 * (last + 1) * m, computes=_computes(rows, idle))


def simulate_times(schedule: Schedule, costs: ActionCosts) -> SimTimes:
    """`simulate`'s clock for a schedule known valid (a generator's, compute-only or lowered),
    its ends and busy times to the bit, without a timeline: the planner prices each schedule
    under many layouts' costs. A deadlock is reported by `simulate`."""
    times = program_times(_program(schedule), costs, schedule.num_stages)
    if times is None:
        simulate(schedule, costs)  # raises the deadlock, with the schedule around it
        raise AssertionError("simulate_times stalled where simulate runs through")
    return times


def compiled_program(schedule: Schedule) -> Program:
    """The schedule as `simulate_times` runs it: integers, worked out once, small enough to
    hand between processes (the planner compiles the schedules it prices in its workers)."""
    return _program(schedule)


def program_times(compiled: Program, costs: ActionCosts, num_stages: int) -> SimTimes | None:
    """`simulate_times` of a compiled schedule of `num_stages` stages; None where it stalls
    (a deadlock, which `simulate` of the schedule explains)."""
    table = cost_table(costs, num_stages)
    pcs, clocks = _run_program(compiled, table, costs.comm)
    if any(pc < len(steps) for pc, steps in zip(pcs, compiled.rows, strict=True)):
        return None
    busy = tuple(sum(map(table.__getitem__, computes)) for computes in compiled.computes)
    return SimTimes(ends=tuple(clocks), busy=busy)


def cost_table(costs: ActionCosts, num_stages: int) -> list[float]:
    """The seconds of each cost index a `Program`'s steps name (stage · 4 + F/B/I/W), then
    the idle step's 0.0."""
    per_stage = (
        costs.per_stage
        or ((costs.forward, costs.backward, costs.input_grad, costs.weight_grad),) * num_stages
    )
    return [*(c for row in per_stage for c in row), 0.0]


def _run_program(
    compiled: Program, table: list[float], comm: float
) -> tuple[list[int], list[float]]:
    """Each rank run until it waits for a message not yet posted, round after round, until
    all end or none moves: each rank's position and clock. Adding the idle step's 0.0 leaves
    a clock as it is, and the waits take the same `max` as `simulate`'s receives."""
    program = compiled.rows
    sent = [-1.0] * compiled.messages
    pcs, clocks = [0] * len(program), [0.0] * len(program)
    moved = True
    while moved:
        moved = False
        for rank, steps in enumerate(program):
            pc, now, start, end = pcs[rank], clocks[rank], pcs[rank], len(steps)
            while pc < end:
                cost, wait, make = steps[pc]
                if wait >= 0:
                    at = sent[wait]
                    if at < 0.0:
                        break
                    at += comm
                    if at > now:
                        now = at
                now += table[cost]
                if make >= 0:
                    sent[make] = now
                pc += 1
            if pc > start:
                pcs[rank], clocks[rank], moved = pc, now, True
    return pcs, clocks
