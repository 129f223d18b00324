"""`simulate_times`: the planner's dry run, `simulate`'s clock without its timeline."""

from __future__ import annotations

import random

import pytest

from engine.schedule import (
    SCHEDULES,
    V_SCHEDULES,
    VIRTUAL_SCHEDULES,
    ActionCosts,
    ScheduleError,
    make_schedule,
    parse_schedule,
    simulate,
    simulate_times,
)
from engine.schedule.passes import as_lowered


def _costs(stages: int, rng: random.Random) -> ActionCosts:
    return ActionCosts(
        per_stage=tuple(tuple(rng.uniform(0.1, 3.0) for _ in range(4)) for _ in range(stages)),
        comm=rng.uniform(0.0, 0.5),
    )


@pytest.mark.parametrize("lowered", [False, True], ids=["compute-only", "lowered"])
@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_the_ends_and_busy_times_are_simulates_to_the_bit(name: str, lowered: bool) -> None:
    rng = random.Random(name)
    v = 2 if name in VIRTUAL_SCHEDULES or name in V_SCHEDULES else 1
    compared = 0
    for pp, m in ((2, 4), (3, 6), (4, 8), (4, 13)):
        try:
            schedule = make_schedule(name, num_ranks=pp, micro_batches=m, stages_per_rank=v)
        except ValueError:
            continue
        if lowered:
            schedule = as_lowered(schedule)
        costs = _costs(schedule.num_stages, rng)
        full = simulate(schedule, costs)
        times = simulate_times(schedule, costs)
        assert times.busy == full.busy
        assert times.ends == tuple(max((t.end for t in row), default=0.0) for row in full.timeline)
        compared += 1
    assert compared >= 2


def test_uniform_costs_are_every_stages() -> None:
    schedule = as_lowered(make_schedule("1f1b", num_ranks=3, micro_batches=5))
    costs = ActionCosts(forward=1.5, backward=2.5, comm=0.25)
    assert max(simulate_times(schedule, costs).ends) == simulate(schedule, costs).step_time


def test_a_compute_only_schedule_is_timed_as_its_lowering() -> None:
    schedule = make_schedule("zb_h1", num_ranks=3, micro_batches=6)
    costs = ActionCosts(comm=0.5)
    assert simulate_times(schedule, costs) == simulate_times(as_lowered(schedule), costs)
    assert max(simulate_times(schedule, costs).ends) == simulate(schedule, costs).step_time


def test_a_deadlock_is_reported_as_simulate_reports_it() -> None:
    both_receive_first = parse_schedule(
        ["0RECV_B0 0F0 0SEND_F0 0B0", "1RECV_F0 1F0 1B0 1SEND_B0"], micro_batches=1
    )
    with pytest.raises(ScheduleError, match="deadlock in schedule 'custom': no rank can move"):
        simulate_times(both_receive_first, ActionCosts())
