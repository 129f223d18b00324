"""Dry-run simulator: a schedule's timeline under per-action costs.

`simulate` executes a (lowered) schedule to find deadlocks, the step time, the bubble and the
in-flight, pending-W and activation peaks a runtime will measure; `steady_state_bubble` runs
steps back to back with no barrier, the regime of the Zero Bubble paper's closed forms. The
planner's clock alone, compiled to integers, is `engine.schedule.program`.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from engine.schedule.actions import COMM_KINDS, Action, ActionKind
from engine.schedule.passes import add_communication, counterpart, is_lowered
from engine.schedule.schedule import Schedule, format_schedule
from engine.schedule.validate import ScheduleError, validate

__all__ = [
    "ActionCosts",
    "SimResult",
    "TimedAction",
    "repeat",
    "simulate",
    "steady_state_bubble",
]

_F, _B, _I, _W = ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W
_RECVS = frozenset({ActionKind.RECV_F, ActionKind.RECV_B})


@dataclass(frozen=True, kw_only=True)
class ActionCosts:
    """Time each action takes in the dry run (any unit; only ratios matter for the bubble)."""

    forward: float = 1.0
    """One micro-batch's F on one stage."""
    backward: float = 2.0
    """One full B (input and weight gradients), about twice a forward."""
    input_grad: float = 1.0
    """The I half of a split backward."""
    weight_grad: float = 1.0
    """The W half of a split backward."""
    comm: float = 0.0
    """Delay from a SEND until its RECV's data arrives; sends cost the sender nothing."""
    per_stage: tuple[tuple[float, float, float, float], ...] | None = None
    """Optional (F, B, I, W) per stage, overriding the four above (unbalanced partitions)."""

    def __post_init__(self) -> None:
        scalars = [getattr(self, f.name) for f in fields(self) if f.name != "per_stage"]
        every = scalars + [c for row in self.per_stage or () for c in row]
        if any(c < 0 for c in every):
            raise ValueError(f"costs must be >= 0, got {self}")

    def of(self, action: Action) -> float:
        """Compute time of an action (0 for SEND/RECV: their delay is `comm`)."""
        if action.kind in COMM_KINDS:
            return 0.0
        costs = (
            (self.forward, self.backward, self.input_grad, self.weight_grad)
            if self.per_stage is None
            else self.per_stage[action.stage]
        )
        return costs[(_F, _B, _I, _W).index(action.kind)]


@dataclass(frozen=True, kw_only=True)
class TimedAction:
    """An action with its simulated start and end (a RECV's span is the wait for its data)."""

    action: Action
    start: float
    end: float


@dataclass(frozen=True, kw_only=True)
class SimResult:
    """What a dry run of one step measured."""

    timeline: tuple[tuple[TimedAction, ...], ...]
    """Per rank, its lowered actions with start and end times."""
    step_time: float
    """Makespan: when the last rank finishes."""
    busy: tuple[float, ...]
    """Per rank, time spent in compute actions."""
    bubble: float
    """Idle fraction, `1 − sum(busy) / (ranks · step_time)`."""
    in_flight_peak: tuple[int, ...]
    """Per stage, most micro-batches whose F ran and whose B (or I) has not."""
    pending_w_peak: tuple[int, ...]
    """Per stage, most micro-batches whose I ran and whose W has not."""
    activation_peak: tuple[int, ...]
    """Per stage, most micro-batches holding activations: F ran, B (or W) has not."""
    steps: int
    """Compute actions on the busiest rank: the step length in unit-cost clock ticks."""


class _Run:
    """Mutable state of one dry run: each rank's position and clock, and when each send ran."""

    def __init__(self, schedule: Schedule, costs: ActionCosts) -> None:
        self.schedule, self.costs = schedule, costs
        self.pc = [0] * schedule.num_ranks
        self.clock = [0.0] * schedule.num_ranks
        self.sent: dict[Action, float] = {}
        self.timeline: list[list[TimedAction]] = [[] for _ in schedule.rows]

    def advance(self, rank: int) -> bool:
        """Run `rank` until it blocks on a receive or ends; whether it moved."""
        row, start_pc = self.schedule.rows[rank], self.pc[rank]
        while self.pc[rank] < len(row):
            action, now = row[self.pc[rank]], self.clock[rank]
            if action.kind in _RECVS:
                sent = self.sent.get(counterpart(action))
                if sent is None:
                    break
                end = max(now, sent + self.costs.comm)
            else:
                end = now + self.costs.of(action)
                if action.kind in COMM_KINDS:
                    self.sent[action] = now
            self.timeline[rank].append(TimedAction(action=action, start=now, end=end))
            self.clock[rank], self.pc[rank] = end, self.pc[rank] + 1
        return self.pc[rank] > start_pc

    def done(self) -> bool:
        return all(pc == len(row) for pc, row in zip(self.pc, self.schedule.rows, strict=True))

    def deadlock(self) -> ScheduleError:
        lines, first = [], None
        for rank, row in enumerate(self.schedule.rows):
            pc = self.pc[rank]
            if pc < len(row):
                match = counterpart(row[pc])
                lines.append(
                    f"rank {rank} waits at {row[pc]} (index {pc}) for {match} "
                    f"from rank {self.schedule.rank_of(match.stage)}"
                )
                first = first or (rank, pc)
        assert first is not None, "a deadlock needs a blocked rank"
        grid = format_schedule(self.schedule, around=first)
        return ScheduleError(
            f"deadlock in schedule {self.schedule.name!r}: no rank can move\n  "
            + "\n  ".join(lines)
            + f"\n{grid}"
        )


def _has_backward(schedule: Schedule) -> bool:
    """Forward-only schedules keep no activations for a backward, so nothing is in flight."""
    return any(a.kind in (_B, _I) for row in schedule.rows for a in row)


def _peaks(schedule: Schedule, opens: ActionKind, closes: tuple[ActionKind, ...]) -> list[int]:
    """Per stage, the largest count of `opens` not yet `closes`d, walking its rank's own order.

    That is the stash size a runtime counts, whatever the timing.
    """
    live, peak = [0] * schedule.num_stages, [0] * schedule.num_stages
    for row in schedule.rows:
        for action in row:
            if action.kind is opens:
                live[action.stage] += 1
                peak[action.stage] = max(peak[action.stage], live[action.stage])
            elif action.kind in closes:
                live[action.stage] -= 1
    return peak


def _bubble(busy: tuple[float, ...], step_time: float) -> float:
    """Idle fraction; written as idle / total so exact inputs give correctly rounded results."""
    total = len(busy) * step_time
    return (total - sum(busy)) / total if total > 0 else 0.0


def simulate(
    schedule: Schedule, costs: ActionCosts | None = None, *, validated: bool = False
) -> SimResult:
    """Dry-run one step; compute-only schedules are lowered first. Raises on deadlock.

    `validated`: the schedule is known valid (the planner's come from the generators and
    `add_communication`, tested valid at every size), so the check, which on a schedule of
    tens of thousands of actions costs more than the simulation, is skipped."""
    costs = costs or ActionCosts()
    if not validated:
        validate(schedule)
    if costs.per_stage is not None and len(costs.per_stage) != schedule.num_stages:
        raise ValueError(
            f"costs.per_stage has {len(costs.per_stage)} entries for {schedule.num_stages} "
            "stages: give (F, B, I, W) for every stage"
        )
    lowered = schedule if is_lowered(schedule) else add_communication(schedule)
    run = _Run(lowered, costs)
    while not run.done():
        moved = [run.advance(rank) for rank in range(lowered.num_ranks)]
        if not any(moved) and not run.done():
            raise run.deadlock()
    step_time = max(run.clock)
    busy = tuple(sum(costs.of(a) for a in row) for row in lowered.rows)
    return SimResult(
        timeline=tuple(tuple(row) for row in run.timeline),
        step_time=step_time,
        busy=busy,
        bubble=_bubble(busy, step_time),
        in_flight_peak=tuple(
            _peaks(lowered, _F, (_B, _I)) if _has_backward(lowered) else [0] * lowered.num_stages
        ),
        pending_w_peak=tuple(_peaks(lowered, _I, (_W,))),
        activation_peak=tuple(
            _peaks(lowered, _F, (_B, _W)) if _has_backward(lowered) else [0] * lowered.num_stages
        ),
        steps=max(sum(a.is_compute for a in row) for row in lowered.rows),
    )


def repeat(schedule: Schedule, iterations: int) -> Schedule:
    """The compute-only schedule run `iterations` times back to back with no barrier between
    steps (micro-batches renumbered), as when the optimizer step does not synchronise ranks."""
    if iterations < 1:
        raise ValueError(f"iterations={iterations} must be at least 1")
    m = schedule.micro_batches
    rows = tuple(
        tuple(
            Action(a.stage, a.kind, a.micro_batch + it * m) for it in range(iterations) for a in row
        )
        for row in schedule.rows
    )
    return replace(schedule, micro_batches=m * iterations, rows=rows, lowered=False)


def steady_state_bubble(schedule: Schedule, costs: ActionCosts | None = None) -> float:
    """Idle time per rank and step once steps follow each other without a barrier.

    The Zero Bubble paper's bubble sizes assume this (it validates the optimizer step after the
    fact instead of synchronising): the period of a long run minus each step's busy time.
    """
    costs = costs or ActionCosts()
    if is_lowered(schedule):
        raise ValueError("steady_state_bubble takes a compute-only schedule")
    period = simulate(repeat(schedule, 4), costs).step_time
    period -= simulate(repeat(schedule, 3), costs).step_time
    busy = simulate(schedule, costs).busy
    return period - max(busy)
