"""The validator and the dry-run simulator: invariants, broken schedules, closed forms."""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest

from engine.schedule.actions import format_actions
from engine.schedule.generators import gpipe, one_f_one_b
from engine.schedule.passes import add_communication
from engine.schedule.schedule import Schedule
from engine.schedule.simulate import ActionCosts, simulate
from engine.schedule.text import parse_schedule
from engine.schedule.validate import ScheduleError, validate

Generator = Callable[[int, int], Schedule]
GENERATORS = [gpipe, one_f_one_b]
SIZES = [(p, m) for p in (2, 3, 4) for m in (1, 2, 4, 8)]


# --- validate: every generated schedule passes --------------------------------------------------


@pytest.mark.parametrize("generator", GENERATORS)
@pytest.mark.parametrize("lowered", [False, True])
def test_validate_accepts_every_generated_schedule(generator: Generator, lowered: bool) -> None:
    for num_ranks in range(1, 5):
        for micro_batches in range(1, 9):
            schedule = generator(num_ranks, micro_batches)
            validate(add_communication(schedule) if lowered else schedule)


def test_validate_accepts_a_split_backward() -> None:
    validate(parse_schedule(["0F0 0F1 0I0 0I1 0W0 0W1"], micro_batches=2))


def test_validate_accepts_stages_placed_round_robin() -> None:
    looped = parse_schedule(["0F0 2F0 2B0 0B0", "1F0 1B0"], micro_batches=1, placement=(0, 1, 0))
    validate(looped)
    validate(add_communication(looped))


# --- validate: broken schedules -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        (["0B0 0F0"], "rank 0: 0B0 at index 0 comes before its 0F0 at index 1"),
        (
            ["0F0 0F1 0B0"],
            "stage 0 micro-batch 1: expected one 0B1, or one 0I1 and one 0W1; found B×0",
        ),
        (["0F0 0F0 0B0"], "stage 0 micro-batch 0: expected exactly one 0F0, found 2"),
        (["0F0 0B0"], "stage 0 micro-batch 1: expected exactly one 0F1, found 0"),
        (["0F1 0F0 0B0 0B1"], "rank 0: 0F0 at index 1 comes after 0F1: stage 0's F actions"),
        (["0F0 0F1 0B1 0B0"], "rank 0: 0B0 at index 3 comes after 0B1: stage 0's B/I actions"),
        (["0F0 0W0 0I0 0F1 0B1"], "rank 0: 0W0 at index 1 comes before its 0I0 at index 2"),
        (
            ["0F0 0F1 0I0 0B1 0W0"],
            "rank 0: 0W0 at index 4 comes after 0B1: stage 0's B/W actions must run in ascending",
        ),
        (["0F0 0I0 0B0 0F1 0B1"], "found B×1, I×1, W×0"),
        (["0F0 0B0 0F2 0F1 0B1"], "rank 0: 0F2 at index 2: micro-batch 2 is outside 0..1"),
        (["0F0 0B0 0F1 0B1 3F0"], "rank 0: 3F0 at index 4: stage 3 is outside 0..0"),
    ],
)
def test_validate_rejects_a_broken_compute_schedule(rows: list[str], message: str) -> None:
    with pytest.raises(ScheduleError, match=re.escape(message)):
        validate(parse_schedule(rows, micro_batches=2))


def test_validate_rejects_an_action_on_a_rank_that_does_not_hold_its_stage() -> None:
    swapped = parse_schedule(["0F0 1B0", "1F0 0B0"], micro_batches=1)
    with pytest.raises(ScheduleError) as raised:
        validate(swapped)
    assert "rank 0: 1B0 at index 1: stage 1 lives on rank 1" in str(raised.value)
    assert "rank 1: 0B0 at index 1: stage 0 lives on rank 0" in str(raised.value)


def test_validate_lists_every_problem_at_once() -> None:
    with pytest.raises(ScheduleError, match=r"breaks 2 rule\(s\)") as raised:
        validate(parse_schedule(["0B0 0F0", "1F0"], micro_batches=1))
    assert str(raised.value).splitlines()[1:] == [
        "  stage 1 micro-batch 0: expected one 1B0, or one 1I0 and one 1W0; found B×0, I×0, W×0",
        "  rank 0: 0B0 at index 0 comes before its 0F0 at index 1",
    ]


def test_schedule_error_is_a_value_error() -> None:
    assert issubclass(ScheduleError, ValueError)


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        (
            ["0F0 0SEND_F0 0RECV_B0 0B0", "1F0 1B0 1SEND_B0"],
            "rank 0: 0SEND_F0 at index 1 has no matching 1RECV_F0 on rank 1",
        ),
        (
            ["0F0 0SEND_F0 0RECV_B0 0B0", "1F0 1B0 1SEND_B0"],
            "rank 1: 1F0 at index 0 needs 1RECV_F0 before it, none found",
        ),
        (
            ["0F0 0RECV_B0 0B0", "1RECV_F0 1F0 1B0 1SEND_B0"],
            "rank 1: 1RECV_F0 at index 0 has no matching 0SEND_F0 on rank 0",
        ),
        (
            ["0F0 0SEND_F0 0RECV_B0 0B0", "1F0 1RECV_F0 1B0 1SEND_B0"],
            "rank 1: 1RECV_F0 at index 1 comes after 1F0 at index 0: a receive must come before",
        ),
        (
            ["0SEND_F0 0F0 0RECV_B0 0B0", "1RECV_F0 1F0 1B0 1SEND_B0"],
            "rank 0: 0SEND_F0 at index 0 comes before 0F0 at index 1: a send must come after",
        ),
        (
            ["0F0 0SEND_F0 0B0 0RECV_B0", "1RECV_F0 1F0 1B0 1SEND_B0"],
            "rank 0: 0RECV_B0 at index 3 comes after 0B0 at index 2",
        ),
        (
            ["0F0 0SEND_F0 0RECV_B0 0B0", "1RECV_F0 1F0 1SEND_B0 1B0"],
            "rank 1: 1SEND_B0 at index 2 comes before 1B0 at index 3",
        ),
        (
            ["0F0 0SEND_F0 0SEND_F0 0RECV_B0 0B0", "1RECV_F0 1F0 1B0 1SEND_B0"],
            "rank 0: 0SEND_F0 at index 1 appears 2 times: each exchange happens once",
        ),
        (
            ["0F0 0SEND_F0 0RECV_B0 0B0", "1RECV_F0 1F0 1SEND_F0 1B0 1SEND_B0"],
            "rank 1: 1SEND_F0 at index 2: stage 1 has no stage 2 to exchange with",
        ),
        (
            ["0F0 0SEND_F0 0RECV_B0 0B0 0SEND_F1", "1RECV_F0 1F0 1B0 1SEND_B0"],
            "rank 0: 0SEND_F1 at index 4: micro-batch 1 is outside 0..0",
        ),
    ],
)
def test_validate_rejects_a_broken_lowered_schedule(rows: list[str], message: str) -> None:
    with pytest.raises(ScheduleError, match=re.escape(message)):
        validate(parse_schedule(rows, micro_batches=1))


def test_validate_rejects_a_send_between_stages_on_one_rank() -> None:
    local = parse_schedule(["0F0 0SEND_F0 1RECV_F0 1F0 1B0 0B0"], micro_batches=1, placement=(0, 0))
    with pytest.raises(ScheduleError, match="stages 0 and 1 share rank 0"):
        validate(local)


# --- simulate: closed forms with uniform costs --------------------------------------------------


@pytest.mark.parametrize("generator", GENERATORS)
@pytest.mark.parametrize(("num_ranks", "micro_batches"), SIZES)
def test_bubble_is_p_minus_1_over_m_plus_p_minus_1(
    generator: Generator, num_ranks: int, micro_batches: int
) -> None:
    result = simulate(generator(num_ranks, micro_batches))
    expected = (num_ranks - 1) / (micro_batches + num_ranks - 1)
    assert result.bubble == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("generator", GENERATORS)
@pytest.mark.parametrize(("num_ranks", "micro_batches"), SIZES)
def test_step_time_is_m_plus_p_minus_1_times_f_plus_b(
    generator: Generator, num_ranks: int, micro_batches: int
) -> None:
    result = simulate(generator(num_ranks, micro_batches), ActionCosts(forward=1, backward=2))
    assert result.step_time == (micro_batches + num_ranks - 1) * 3
    assert result.busy == (micro_batches * 3.0,) * num_ranks
    assert result.steps == 2 * micro_batches


@pytest.mark.parametrize(("num_ranks", "micro_batches"), SIZES)
def test_one_f_one_b_keeps_min_of_p_minus_s_and_m_in_flight(
    num_ranks: int, micro_batches: int
) -> None:
    result = simulate(one_f_one_b(num_ranks, micro_batches))
    expected = tuple(min(num_ranks - s, micro_batches) for s in range(num_ranks))
    assert result.in_flight_peak == expected


@pytest.mark.parametrize(("num_ranks", "micro_batches"), SIZES)
def test_gpipe_keeps_every_micro_batch_in_flight(num_ranks: int, micro_batches: int) -> None:
    assert simulate(gpipe(num_ranks, micro_batches)).in_flight_peak == (micro_batches,) * num_ranks


@pytest.mark.parametrize(
    "costs",
    [ActionCosts(), ActionCosts(forward=3, backward=0.5, comm=2), ActionCosts(comm=10)],
)
def test_in_flight_peak_follows_rank_order_not_timing(costs: ActionCosts) -> None:
    assert simulate(one_f_one_b(4, 8), costs).in_flight_peak == (4, 3, 2, 1)


def test_pending_w_peak_counts_i_done_and_w_not() -> None:
    split = parse_schedule(["0F0 0F1 0I0 0I1 0W0 0W1"], micro_batches=2)
    result = simulate(split)
    assert (result.in_flight_peak, result.pending_w_peak) == ((2,), (2,))
    assert result.step_time == 6.0


# --- simulate: timing ---------------------------------------------------------------------------


def _timeline(schedule: Schedule, costs: ActionCosts) -> list[list[tuple[str, float, float]]]:
    return [
        [(str(t.action), t.start, t.end) for t in row] for row in simulate(schedule, costs).timeline
    ]


def test_simulate_timeline_of_gpipe_2_1_with_comm() -> None:
    # A send costs its rank nothing; the data lands `comm` later, where the RECV waits for it.
    assert _timeline(gpipe(2, 1), ActionCosts(comm=0.5)) == [
        [("0F0", 0, 1), ("0SEND_F0", 1, 1), ("0RECV_B0", 1, 5), ("0B0", 5, 7)],
        [("1RECV_F0", 0, 1.5), ("1F0", 1.5, 2.5), ("1B0", 2.5, 4.5), ("1SEND_B0", 4.5, 4.5)],
    ]


def test_comm_time_increases_step_time() -> None:
    schedule = one_f_one_b(3, 4)
    base = simulate(schedule).step_time
    assert simulate(schedule, ActionCosts(comm=0.25)).step_time > base
    assert simulate(gpipe(2, 1), ActionCosts(comm=0.5)).step_time == 6 + 2 * 0.5


def test_per_stage_costs_override_the_uniform_ones() -> None:
    costs = ActionCosts(per_stage=((1, 2, 1, 1), (2, 4, 1, 1)))
    result = simulate(gpipe(2, 1), costs)
    assert (result.step_time, result.busy, result.bubble) == (9.0, (3.0, 6.0), 0.5)


def test_simulate_lowers_a_compute_only_schedule_itself() -> None:
    schedule = one_f_one_b(3, 4)
    assert simulate(schedule) == simulate(add_communication(schedule))
    assert format_actions(t.action for t in simulate(gpipe(2, 1)).timeline[1]) == (
        "1RECV_F0 1F0 1B0 1SEND_B0"
    )


def test_simulate_detects_a_deadlock_and_names_each_blocked_rank() -> None:
    both_receive_first = parse_schedule(
        ["0RECV_B0 0F0 0SEND_F0 0B0", "1RECV_F0 1F0 1B0 1SEND_B0"], micro_batches=1
    )
    with pytest.raises(ScheduleError) as raised:
        simulate(both_receive_first)
    assert str(raised.value).splitlines() == [
        "deadlock in schedule 'custom': no rank can move",
        "  rank 0 waits at 0RECV_B0 (index 0) for 1SEND_B0 from rank 1",
        "  rank 1 waits at 1RECV_F0 (index 0) for 0SEND_F0 from rank 0",
        "rank 0: >>0RECV_B0<< 0F0 0SEND_F0 0B0",
        "rank 1: 1RECV_F0 1F0 1B0 1SEND_B0",
    ]


def test_simulate_validates_first() -> None:
    with pytest.raises(ScheduleError, match="comes before its 0F0"):
        simulate(parse_schedule(["0B0 0F0"], micro_batches=1))


def test_action_costs_reject_negative_times() -> None:
    with pytest.raises(ValueError, match="costs must be >= 0"):
        ActionCosts(forward=-1)
    with pytest.raises(ValueError, match="costs must be >= 0"):
        ActionCosts(per_stage=((1, 2, 1, -1),))


def test_simulate_rejects_per_stage_costs_of_the_wrong_length() -> None:
    with pytest.raises(ValueError, match="1 entries for 2 stages"):
        simulate(gpipe(2, 1), ActionCosts(per_stage=((1, 2, 1, 1),)))


def test_forward_only_inference_schedule_is_valid_and_simulates() -> None:
    from engine.schedule.generators import inference

    schedule = inference(3, 4)
    validate(schedule)
    result = simulate(schedule)
    assert result.in_flight_peak == (0, 0, 0)
    assert result.step_time == pytest.approx(4 + 3 - 1)
