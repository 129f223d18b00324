"""The simulator's clock where the ranks share fewer CPU cores than they number: a CPU run on
one host (`meshpipe plan --profile`, scripts/plan_check.py), four ranks on two cores.

`program_times` gives each rank its own device. On a host the operating system shares the
cores fairly among the ranks computing at a moment, so an action runs at full speed while at
most `slots` ranks compute and slower when more do, and at full speed again when a rank waits
(a pipeline's warm-up and drain). Scaling every action by ranks over cores misses that: 1F1B
over four ranks and eight micro-batches on two cores (F 1, B 2, a transfer 0.1) takes 51.4
where every action at half speed takes 67.6.

`shared_timeline` draws the same clock action by action: the figure of a plan priced so
(`meshpipe plan --plot`) shows the step the plan's line states.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

from engine.schedule.program import (
    Program,
    SimTimes,
    compiled_program,
    cost_table,
    program_times,
)
from engine.schedule.schedule import Schedule
from engine.schedule.simulate import ActionCosts, SimResult, TimedAction, simulate

__all__ = ["shared_program_times", "shared_timeline"]

_DONE = 1e-12
"""Work left (in seconds of one core) below which a compute has ended: the clock advances by
sums of quotients, so an action's remaining work reaches 0 only up to rounding."""


def shared_program_times(
    compiled: Program,
    costs: ActionCosts,
    num_stages: int,
    slots: float,
    waits: Sequence[tuple[float, float, float, float]] | None = None,
) -> SimTimes | None:
    """`program_times` of a compiled schedule whose ranks compute on `slots` cores shared
    fairly among those computing at each moment (each of `n` computing advances at
    `min(1, slots / n)` of its own speed); the same where `slots` covers every rank. `waits`:
    per stage, the seconds of its F, B, I and W spent in collectives, which take their time
    whatever the cores do (each action computes, then waits). Busy times are each rank's
    whole actions on a core of its own. None where the program stalls."""
    if slots >= len(compiled.rows):
        return program_times(compiled, costs, num_stages)
    host = _host(compiled, costs, num_stages, slots, waits)
    if host.run() is None:
        return None
    table = cost_table(costs, num_stages)
    busy = tuple(sum(map(table.__getitem__, computes)) for computes in compiled.computes)
    return SimTimes(ends=tuple(host.ends), busy=busy)


def shared_timeline(
    lowered: Schedule,
    costs: ActionCosts,
    slots: float,
    waits: Sequence[tuple[float, float, float, float]] | None = None,
) -> SimResult:
    """`simulate`'s result of a lowered schedule known valid, its actions timed on `slots`
    shared cores as `shared_program_times` times them: each action starts where its rank's
    previous one ended and ends where the shared clock finished it. Busy times and in-flight
    peaks are the rank's own order's, as `simulate`'s."""
    own = simulate(lowered, costs, validated=True)
    if slots >= lowered.num_ranks:
        return own
    host = _host(compiled_program(lowered), costs, lowered.num_stages, slots, waits)
    if host.run() is None:
        raise AssertionError("a schedule `simulate` runs through stalled on shared cores")
    timeline = tuple(
        tuple(
            TimedAction(action=timed.action, start=start, end=end)
            for timed, start, end in zip(row, [0.0, *ends], ends, strict=False)
        )
        for row, ends in zip(own.timeline, host.finished, strict=True)
    )
    step = max(host.ends)
    total = lowered.num_ranks * step
    bubble = (total - sum(own.busy)) / total if total > 0 else 0.0
    return replace(own, timeline=timeline, step_time=step, bubble=bubble)


def _host(
    compiled: Program,
    costs: ActionCosts,
    num_stages: int,
    slots: float,
    waits: Sequence[tuple[float, float, float, float]] | None,
) -> _Host:
    """The dry run of `compiled` on `slots` shared cores, each step's work its compute less
    its collectives' wait."""
    table = cost_table(costs, num_stages)
    waited = [*(w for row in waits or ((0.0,) * 4,) * num_stages for w in row), 0.0]
    work = [max(0.0, c - w) for c, w in zip(table, waited, strict=True)]
    return _Host(compiled, work, waited, costs.comm, slots)


class _Host:
    """One dry run on shared cores: each rank's position, the work left of the compute it
    runs, when the collective it waits in ends, when each message was posted, and when each
    of its steps finished (`finished`)."""

    def __init__(
        self, compiled: Program, work: list[float], waits: list[float], comm: float, slots: float
    ) -> None:
        self.program, self.work, self.waits = compiled.rows, work, waits
        self.comm, self.slots = comm, slots
        self.sent = [-1.0] * compiled.messages
        self.pcs, self.ends = [0] * len(self.program), [0.0] * len(self.program)
        self.finished: list[list[float]] = [[] for _ in self.program]
        self.left: dict[int, float] = {}
        self.waiting: dict[int, float] = {}

    def run(self) -> list[float] | None:
        """Event by event: start what can start, then advance the clock to the next end of a
        compute or a collective, or arrival of a message; each rank's end, or None where
        none can move."""
        now = 0.0
        while True:
            arrivals = self._start_all(now)
            events = [at for at in (*arrivals, *self.waiting.values()) if at is not None]
            if not self.left and not events:
                finished = all(pc == len(s) for pc, s in zip(self.pcs, self.program, strict=True))
                return self.ends if finished else None
            rate = min(1.0, self.slots / len(self.left)) if self.left else 0.0
            step = min(
                [
                    min(self.left.values()) / rate if self.left else math.inf,
                    *(at - now for at in events),
                ]
            )
            now += step
            for rank in list(self.left):
                self.left[rank] -= step * rate
                if self.left[rank] <= _DONE:
                    del self.left[rank]
                    self._computed(rank, now)
            for rank, at in list(self.waiting.items()):
                if at <= now:
                    del self.waiting[rank]
                    self._finish(rank, now)

    def _start_all(self, now: float) -> list[float | None]:
        """`_start` of every rank, again while one moved: a step of no work (a lowered row's
        send) posts its message at once, which a rank started before it may be waiting for."""
        while True:
            before = list(self.pcs)
            arrivals = [self._start(rank, now) for rank in range(len(self.program))]
            if self.pcs == before:
                return arrivals

    def _start(self, rank: int, now: float) -> float | None:
        """Move `rank` through the steps it can take at `now` until it computes, waits or
        ends: the time its awaited message arrives where that is later, else None."""
        steps = self.program[rank]
        while rank not in self.left and rank not in self.waiting and self.pcs[rank] < len(steps):
            cost, wait, _ = steps[self.pcs[rank]]
            if wait >= 0:
                if self.sent[wait] < 0.0:
                    return None
                if self.sent[wait] + self.comm > now:
                    return self.sent[wait] + self.comm
            if self.work[cost] > 0.0:
                self.left[rank] = self.work[cost]
                return None
            self._computed(rank, now)
        return None

    def _computed(self, rank: int, now: float) -> None:
        """The current step's compute is done: its collectives' wait, or its end."""
        cost = self.program[rank][self.pcs[rank]][0]
        if self.waits[cost] > 0.0:
            self.waiting[rank] = now + self.waits[cost]
        else:
            self._finish(rank, now)

    def _finish(self, rank: int, now: float) -> None:
        """The rank's current step ends at `now`: its message posted, its position on."""
        make = self.program[rank][self.pcs[rank]][2]
        if make >= 0:
            self.sent[make] = now
        self.pcs[rank] += 1
        self.ends[rank] = now
        self.finished[rank].append(now)
