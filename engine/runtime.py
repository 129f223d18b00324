"""The one interpreter: runs a rank's lowered action list through a handler table.

It knows nothing about stages or communication; the engine supplies a handler per action kind.
It times every action (for the measured bubble and the trace) and, on any failure, says which
rank, stage, micro-batch and action failed, with the schedule around it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from engine.actions import Action, ActionKind
from engine.schedules import Schedule, format_schedule

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
    clock: Callable[[], float] = time.perf_counter,
    origin: float | None = None,
) -> list[ActionTiming]:
    """Run `schedule.rows[rank]` in order; returns each action's timing from `origin`."""
    origin = clock() if origin is None else origin
    timings: list[ActionTiming] = []
    for index, action in enumerate(schedule.rows[rank]):
        start = clock()
        try:
            handlers[action.kind](action)
        except Exception as error:
            raise PipelineRuntimeError(
                f"rank {rank} failed at action {action} (stage {action.stage}, "
                f"{action.kind.name}, micro-batch {action.micro_batch}), action {index} of its "
                f"schedule '{schedule.name}':\n{error}\n"
                f"{format_schedule(schedule, around=(rank, index))}"
            ) from error
        timings.append(ActionTiming(action, start - origin, clock() - origin))
    return timings
