"""The simulator's clock where the ranks share fewer CPU cores than they number: a CPU run on
one host (`meshpipe plan --profile`, scripts/plan_check.py), four ranks on two cores.

`program_times` gives each rank its own device. On a host the operating system shares the
cores fairly among the ranks computing at a moment, so an action runs at full speed while at
most `slots` ranks compute and slower when more do, and at full speed again when a rank waits
(a pipeline's warm-up and drain). Scaling every action by ranks over cores misses that: 1F1B
over four ranks and eight micro-batches on two cores (F 1, B 2, a transfer 0.1) takes 51.4
where every action at half speed takes 67.6.
"""

from __future__ import annotations

from engine.schedule.program import Program, SimTimes, program_times
from engine.schedule.simulate import ActionCosts

__all__ = ["shared_program_times"]

_DONE = 1e-12
"""Work left (in seconds of one core) below which a compute has ended: the clock advances by
sums of quotients, so an action's remaining work reaches 0 only up to rounding."""


def shared_program_times(
    compiled: Program, costs: ActionCosts, num_stages: int, slots: float
) -> SimTimes | None:
    """`program_times` of a compiled schedule whose ranks compute on `slots` cores shared
    fairly among those computing at each moment (each of `n` computing advances at
    `min(1, slots / n)` of its own speed); the same where `slots` covers every rank. Busy
    times are each rank's work on a core of its own. None where the program stalls."""
    ranks = len(compiled.rows)
    if slots >= ranks:
        return program_times(compiled, costs, num_stages)
    per_stage = (
        costs.per_stage
        or ((costs.forward, costs.backward, costs.input_grad, costs.weight_grad),) * num_stages
    )
    table = [*(c for row in per_stage for c in row), 0.0]
    ends = _run_shared(compiled, table, costs.comm, slots)
    if ends is None:
        return None
    busy = tuple(sum(map(table.__getitem__, computes)) for computes in compiled.computes)
    return SimTimes(ends=tuple(ends), busy=busy)


def _run_shared(
    compiled: Program, table: list[float], comm: float, slots: float
) -> list[float] | None:
    """Event by event: start what can start, then advance the clock to the next end of a
    compute or arrival of a message; each rank's end, or None where none can move."""
    program, sent = compiled.rows, [-1.0] * compiled.messages
    pcs, ends = [0] * len(program), [0.0] * len(program)
    left: dict[int, float] = {}  # rank -> work left of the compute it runs
    now = 0.0
    while True:
        arrivals = [
            _start(program, rank, pcs, sent, left, table, comm, now, ends)
            for rank in range(len(program))
        ]
        if not left and all(pc == len(steps) for pc, steps in zip(pcs, program, strict=True)):
            return ends
        pending = [at for at in arrivals if at is not None]
        rate = min(1.0, slots / len(left)) if left else 0.0
        finish = min(left.values()) / rate if left else float("inf")
        step = min([finish, *(at - now for at in pending)])
        if step == float("inf"):
            return None
        now += step
        for rank in list(left):
            left[rank] -= step * rate
            if left[rank] <= _DONE:
                del left[rank]
                _finish(program, rank, pcs, sent, now, ends)


def _start(
    program: tuple[tuple[tuple[int, int, int], ...], ...],
    rank: int,
    pcs: list[int],
    sent: list[float],
    left: dict[int, float],
    table: list[float],
    comm: float,
    now: float,
    ends: list[float],
) -> float | None:
    """Move `rank` through the steps it can take at `now` until it computes, waits or ends:
    the time its awaited message arrives where that is later, else None."""
    steps = program[rank]
    while rank not in left and pcs[rank] < len(steps):
        cost, wait, _ = steps[pcs[rank]]
        if wait >= 0:
            if sent[wait] < 0.0:
                return None
            if sent[wait] + comm > now:
                return sent[wait] + comm
        if table[cost] > 0.0:
            left[rank] = table[cost]
            return None
        _finish(program, rank, pcs, sent, now, ends)
    return None


def _finish(
    program: tuple[tuple[tuple[int, int, int], ...], ...],
    rank: int,
    pcs: list[int],
    sent: list[float],
    now: float,
    ends: list[float],
) -> None:
    """The rank's current step ends at `now`: its message posted, its position moved on."""
    _, _, make = program[rank][pcs[rank]]
    if make >= 0:
        sent[make] = now
    pcs[rank] += 1
    ends[rank] = now
