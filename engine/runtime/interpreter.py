"""The one interpreter: runs a rank's lowered action list through a handler table.

It knows nothing about stages or communication; the engine supplies a handler per action kind.
It times every action on the device's clock (for the measured bubble and the trace) and, on
any failure, says which rank, stage, micro-batch and action failed, with the schedule around it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from engine.comm.heartbeat import note
from engine.runtime.step_clock import HostClock, StepClock
from engine.schedule.actions import Action, ActionKind
from engine.schedule.schedule import Schedule, format_schedule

__all__ = ["ActionTiming", "Handler", "PipelineRuntimeError", "execute"]

Handler = Callable[[Action], None]


@dataclass(frozen=True, slots=True)
class ActionTiming:
    """When an action ran, in seconds from the start of the step."""

    action: Action
    start: float
    end: float


class PipelineRuntimeError(RuntimeError):
    """An action failed; the message locates it in the schedule."""


def execute(
    schedule: Schedule,
    rank: int,
    handlers: Mapping[ActionKind, Handler],
    *,
    clock: StepClock | None = None,
    origin: float | None = None,
) -> list[ActionTiming]:
    """Run `schedule.rows[rank]` in order; returns each action's timing from `origin` (the
    first action's start by default), on `clock` (the host's by default)."""
    clock = clock or HostClock()
    marks: list[tuple[Action, int, int]] = []
    for index, action in enumerate(schedule.rows[rank]):
        start = clock.mark()
        note(
            f"action {action} ({action.kind.name} of stage {action.stage}, micro-batch "
            f"{action.micro_batch})"
        )
        try:
            handlers[action.kind](action)
        except Exception as error:
            raise PipelineRuntimeError(
                f"rank {rank} failed at action {action} (stage {action.stage}, "
                f"{action.kind.name}, micro-batch {action.micro_batch}), action {index} of its "
                f"schedule '{schedule.name}':\n{error}\n"
                f"{format_schedule(schedule, around=(rank, index))}"
            ) from error
        marks.append((action, start, clock.mark()))
    times = clock.seconds()
    if origin is None:
        origin = times[0] if times else 0.0
    return [ActionTiming(action, times[s] - origin, times[e] - origin) for action, s, e in marks]
