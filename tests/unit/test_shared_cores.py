"""The simulator's clock where a host's ranks share fewer cores than they number: each of the
ranks computing at a moment runs at `min(1, cores / computing)` of its speed."""

from __future__ import annotations

import pytest

from engine.schedule import (
    ActionCosts,
    add_communication,
    compiled_program,
    make_schedule,
    program_times,
    shared_program_times,
    shared_timeline,
    simulate,
)
from engine.schedule.program import Program

_COSTS = ActionCosts(forward=1.0, backward=2.0, input_grad=1.2, weight_grad=0.8, comm=0.1)


def _alone(*works: float) -> tuple[Program, ActionCosts]:
    """One compute per rank, no messages: rank r's work is `works[r]`."""
    rows = tuple(((4 * r, -1, -1),) for r in range(len(works)))
    per_stage = tuple((w, 0.0, 0.0, 0.0) for w in works)
    program = Program(rows=rows, messages=0, computes=tuple((4 * r,) for r in range(len(works))))
    return program, ActionCosts(per_stage=per_stage)


def test_two_ranks_on_one_core_share_it_until_the_shorter_ends() -> None:
    """Both at half speed until the first's 1 s of work is done at 2 s; then the second's
    last second alone."""
    program, costs = _alone(1.0, 2.0)
    times = shared_program_times(program, costs, 2, 1.0)
    assert times is not None
    assert times.ends == pytest.approx((2.0, 3.0), abs=1e-12)
    assert times.busy == (1.0, 2.0)  # each rank's work on a core of its own


def test_three_ranks_on_two_cores_run_at_two_thirds_speed_while_all_compute() -> None:
    program, costs = _alone(2.0, 2.0, 2.0)
    times = shared_program_times(program, costs, 3, 2.0)
    assert times is not None and times.ends == pytest.approx((3.0, 3.0, 3.0), abs=1e-12)


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb_h1", "interleaved_1f1b"])
def test_with_a_core_for_every_rank_the_clock_is_the_simulators_own(name: str) -> None:
    schedule = make_schedule(
        name, num_ranks=4, micro_batches=8, stages_per_rank=2 if name == "interleaved_1f1b" else 1
    )
    program = compiled_program(schedule)
    own = program_times(program, _COSTS, schedule.num_stages)
    assert shared_program_times(program, _COSTS, schedule.num_stages, 4.0) == own


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb_h1", "zb_h2"])
@pytest.mark.parametrize("cores", [1.0, 1.5, 2.0, 3.0])
def test_sharing_ends_between_own_cores_and_every_action_slowed_by_ranks_over_cores(
    name: str, cores: float
) -> None:
    """No sooner than on a device each, nor than the host's cores can do the whole step's
    work; no later than every action scaled by ranks per core (the old estimate), since
    each action runs at least that fast."""
    schedule = make_schedule(name, num_ranks=4, micro_batches=8)
    program = compiled_program(schedule)
    own = program_times(program, _COSTS, 4)
    slowed = ActionCosts(
        forward=4 / cores,
        backward=8 / cores,
        input_grad=4.8 / cores,
        weight_grad=3.2 / cores,
        comm=0.1,
    )
    scaled = program_times(program, slowed, 4)
    shared = shared_program_times(program, _COSTS, 4, cores)
    assert own is not None and scaled is not None and shared is not None
    step = max(shared.ends)
    assert max(own.ends) <= step + 1e-9
    assert sum(shared.busy) / cores <= step + 1e-9
    assert step <= max(scaled.ends) + 1e-9
    assert shared.busy == own.busy


def test_a_pipelines_warm_up_and_drain_run_faster_than_its_steady_state_on_shared_cores() -> None:
    """1F1B over four ranks and eight micro-batches on two cores: its warm-up and drain leave
    cores free, so the step is shorter than every action at half speed by a fifth and more
    (51.4 against 67.6)."""
    program = compiled_program(make_schedule("1f1b", num_ranks=4, micro_batches=8))
    costs = ActionCosts(forward=1.0, backward=2.0, comm=0.1)
    shared = shared_program_times(program, costs, 4, 2.0)
    scaled = program_times(program, ActionCosts(forward=2.0, backward=4.0, comm=0.1), 4)
    assert shared is not None and scaled is not None
    assert max(shared.ends) < 0.8 * max(scaled.ends)


def test_a_program_that_stalls_on_shared_cores_gives_none() -> None:
    """A rank waiting for a message no rank posts."""
    program = Program(rows=(((8, 0, -1),), ((0, -1, -1),)), messages=1, computes=((), (0,)))
    assert shared_program_times(program, ActionCosts(), 2, 1.0) is None


def test_a_collectives_wait_leaves_the_core_to_the_ranks_that_compute() -> None:
    """Rank 0 computes 1 s then waits 1 s in a collective; rank 1 computes 2 s, one core:
    both at half speed until rank 0's compute is done at 2 s, then rank 1 alone, done at 3 s
    as rank 0's wait ends. Counted as compute, both would end at 4 s."""
    program, costs = _alone(2.0, 2.0)
    waits = ((1.0, 0.0, 0.0, 0.0), (0.0, 0.0, 0.0, 0.0))
    times = shared_program_times(program, costs, 2, 1.0, waits)
    assert times is not None and times.ends == pytest.approx((3.0, 3.0), abs=1e-12)
    counted = shared_program_times(program, costs, 2, 1.0)
    assert counted is not None and counted.ends == pytest.approx((4.0, 4.0), abs=1e-12)
    assert times.busy == (2.0, 2.0)


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb_h1", "interleaved_1f1b"])
def test_a_shared_timeline_ends_each_rank_where_the_shared_clock_does(name: str) -> None:
    """The figure's timeline and the search's price agree: each rank's last action ends
    where `shared_program_times` ends it, the step and bubble follow."""
    v = 2 if name == "interleaved_1f1b" else 1
    schedule = make_schedule(name, num_ranks=4, micro_batches=8, stages_per_rank=v)
    timed = shared_timeline(add_communication(schedule), _COSTS, 2.0)
    clock = shared_program_times(compiled_program(schedule), _COSTS, schedule.num_stages, 2.0)
    assert clock is not None
    ends = [row[-1].end for row in timed.timeline]
    assert ends == pytest.approx(clock.ends, rel=1e-12)
    assert timed.step_time == max(ends)
    assert timed.busy == clock.busy
    assert timed.bubble == pytest.approx(1 - sum(clock.busy) / (4 * max(ends)), rel=1e-12)


@pytest.mark.parametrize("cores", [1.0, 2.0, 3.0])
def test_each_action_of_a_shared_timeline_starts_where_its_ranks_last_ended(
    cores: float,
) -> None:
    """A rank runs its actions in turn, none faster than on a core of its own, and the
    in-flight peaks are its own order's."""
    lowered = add_communication(make_schedule("1f1b", num_ranks=4, micro_batches=8))
    own = simulate(lowered, _COSTS)
    timed = shared_timeline(lowered, _COSTS, cores)
    for own_row, row in zip(own.timeline, timed.timeline, strict=True):
        assert [t.action for t in row] == [t.action for t in own_row]
        assert [t.start for t in row] == [0.0, *(t.end for t in row[:-1])]
        for mine, alone in zip(row, own_row, strict=True):
            assert mine.end - mine.start >= alone.end - alone.start - 1e-9 or alone.start > 0
            assert mine.end - mine.start >= _COSTS.of(mine.action) - 1e-9
    assert timed.in_flight_peak == own.in_flight_peak
    assert timed.step_time >= own.step_time - 1e-9


def test_a_shared_timeline_with_a_core_for_every_rank_is_simulates_own() -> None:
    lowered = add_communication(make_schedule("zb_h1", num_ranks=4, micro_batches=8))
    assert shared_timeline(lowered, _COSTS, 4.0) == simulate(lowered, _COSTS)
