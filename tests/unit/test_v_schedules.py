"""The V placement and the schedules built on it (ZB-V, V-Half, V-Min): literal tables,
validity, and the papers' bubble and activation formulas for uniform costs."""

from __future__ import annotations

import pytest

from engine.config import ScheduleConfig
from engine.memory.replay import in_flight
from engine.schedule import (
    PLACEMENTS,
    V_SCHEDULES,
    Schedule,
    dualpipe_v,
    looped_bfs,
    make_schedule,
    one_f_one_b,
    placement_of,
    v_half,
    v_min,
    zb_v,
)
from engine.schedule.actions import format_actions
from engine.schedule.placement import placement_name, with_placement
from engine.schedule.simulate import ActionCosts, simulate, steady_state_bubble
from engine.schedule.validate import validate

UNIFORM = ActionCosts(forward=1, backward=2, input_grad=1, weight_grad=1)


def rows(schedule: Schedule) -> list[str]:
    return [format_actions(row) for row in schedule.rows]


def rank_activation_peak(schedule: Schedule) -> float:
    """The busiest rank's peak activations in micro-batches of its share of the model: a stage
    of a rank holding v stages keeps 1/v of a micro-batch's activations per stash."""
    per_rank = schedule.num_stages // schedule.num_ranks
    return max(in_flight([a for a in row if a.is_compute]) for row in schedule.rows) / per_rank


def test_v_placement_puts_rank_r_on_stages_r_and_2p_minus_1_minus_r() -> None:
    assert placement_of("v", 4, 2) == (0, 1, 2, 3, 3, 2, 1, 0)
    assert placement_of("loop", 4, 2) == (0, 1, 2, 3, 0, 1, 2, 3)


def test_v_placement_with_more_chunks_zigzags() -> None:
    assert placement_of("v", 2, 3) == (0, 1, 1, 0, 0, 1)


def test_zb_v_literal_table_for_two_ranks() -> None:
    # Zero Bubble paper, ZB-V: rank r warms up with 2(P-r)-1 forwards of stage r, then r
    # forward pairs; the second chunk's I and W follow its F at once.
    assert rows(zb_v(2, 4)) == [
        "0F0 0F1 0F2 3F0 3I0 3W0 3F1 3I1 3W1 0F3 0I0 0W0 3F2 3I2 3W2 0I1 0W1 3F3 3I3 3W3 "
        "0I2 0W2 0I3 0W3",
        "1F0 2F0 1F1 2F1 2I0 2W0 1F2 1I0 1W0 2F2 2I1 2W1 1F3 1I1 1W1 2F3 2I2 2W2 1I2 2I3 "
        "1I3 1W2 2W3 1W3",
    ]


def test_v_min_literal_table_for_two_ranks() -> None:
    # Block (P=2): rank 0 runs F down, F up, I up, I down at slots 0, 3, 4, 7; rank 1 at
    # 1, 2, 5, 6; every 6 slots again; a free slot runs the oldest W (the up stage's first).
    assert rows(v_min(2, 4)) == [
        "0F0 3F0 3I0 3W0 0F1 0I0 0W0 3F1 3I1 3W1 0F2 0I1 0W1 3F2 3I2 3W2 0F3 0I2 0W2 3F3 "
        "3I3 3W3 0I3 0W3",
        "1F0 2F0 2I0 1I0 1F1 2F1 2W0 1W0 2I1 1I1 1F2 2F2 2W1 1W1 2I2 1I2 1F3 2F3 2W2 1W2 "
        "2I3 1I3 2W3 1W3",
    ]


def test_v_half_literal_table_for_two_ranks() -> None:
    # Block (P=2): rank 0 at slots 0, 4, 8, 13; rank 1 at 2, 3, 10, 12.
    assert rows(v_half(2, 4)) == [
        "0F0 3F0 0F1 3I0 3W0 3F1 0F2 0I0 3I1 3W1 3F2 0W0 0F3 0I1 3I2 3W2 3F3 0W1 0I2 3I3 "
        "3W3 0W2 0I3 0W3",
        "1F0 2F0 1F1 2F1 2I0 2W0 1I0 1W0 1F2 2F2 2I1 2W1 1I1 1W1 1F3 2F3 2I2 2W2 1I2 1W2 "
        "2I3 2W3 1I3 1W3",
    ]


def test_dualpipe_v_literal_table_for_two_ranks() -> None:
    # DeepSeek's DualPipeV (as torch's ScheduleDualPipeV): warm-up F's, split backwards of the
    # up stage with their W at once, then F/B pairs of the two stages, a split drain.
    assert rows(dualpipe_v(2, 4)) == [
        "0F0 0F1 0F2 3F0 3I0 3W0 3F1 0F3 3B1 3F2 0B0 3B2 3F3 0B1 3B3 0I2 0W2 0I3 0W3",
        "1F0 2F0 1F1 2F1 1F2 2B0 2F2 1B0 1F3 2B1 2F3 1B1 2B2 1B2 2I3 1I3 2W3 1W3",
    ]


def test_dualpipe_v_needs_a_micro_batch_per_stage() -> None:
    with pytest.raises(ValueError, match="m=3, 4 stages.*--micro-batches 4 or more"):
        dualpipe_v(2, 3)


@pytest.mark.parametrize(("p", "m"), [(2, 4), (3, 6), (4, 8), (4, 16)])
def test_dualpipe_v_idles_like_zb_v_for_uniform_costs(p: int, m: int) -> None:
    assert simulate(dualpipe_v(p, m), UNIFORM).bubble == simulate(zb_v(p, m), UNIFORM).bubble


@pytest.mark.parametrize("name", sorted(V_SCHEDULES))
@pytest.mark.parametrize(("p", "m"), [(1, 1), (1, 3), (2, 1), (2, 3), (3, 5), (4, 8), (5, 12)])
def test_v_schedules_are_valid_and_never_deadlock(name: str, p: int, m: int) -> None:
    m = max(m, 2 * p) if name == "dualpipe_v" else m
    schedule = V_SCHEDULES[name](p, m)
    validate(schedule)
    assert schedule.placement == placement_of("v", p, 2)
    assert simulate(schedule, UNIFORM).step_time > 0


@pytest.mark.parametrize(("p", "m"), [(2, 3), (3, 5), (4, 8), (4, 16), (6, 12)])
def test_zb_v_has_no_bubble_back_to_back_and_1f1bs_activations(p: int, m: int) -> None:
    # Zero Bubble paper: with T_F = T_I = T_W, ZB-V's steady state is bubble-free once
    # m >= 2P - 1, at the peak activations of 1F1B (P micro-batches).
    costs = ActionCosts(forward=1, input_grad=1, weight_grad=1)
    assert steady_state_bubble(zb_v(p, m), costs) == 0
    assert rank_activation_peak(zb_v(p, m)) == rank_activation_peak(one_f_one_b(p, m)) == p


@pytest.mark.parametrize("p", [2, 3, 4, 5, 6, 8, 12])
def test_v_half_and_v_min_peaks_are_the_papers(p: int) -> None:
    # Qi et al. 2024 (controllable memory), by micro-batch: V-Half (P+2)//2, V-Min (P+4)//3.
    m = 3 * p
    assert rank_activation_peak(v_half(p, m)) == (p + 2) // 2
    assert rank_activation_peak(v_min(p, m)) == (p + 4) // 3


def test_v_half_and_v_min_reach_half_and_a_third_of_1f1b_with_many_ranks() -> None:
    p, m = 20, 40
    base = rank_activation_peak(one_f_one_b(p, m))
    assert rank_activation_peak(v_half(p, m)) <= 0.55 * base
    assert rank_activation_peak(v_min(p, m)) <= 0.4 * base


@pytest.mark.parametrize(
    ("name", "target", "p", "m", "peak"),
    [("v_half", 0.55, 11, 11, 6), ("v_min", 0.4, 10, 10, 4)],
)
def test_the_smallest_pipeline_meeting_the_issues_ratio(
    name: str, target: float, p: int, m: int, peak: int
) -> None:
    # (P + 2) // 2 <= 0.55 P first at P = 11 (6/11), (P + 4) // 3 <= 0.4 P at P = 10 (4/10),
    # once 1F1B holds its P micro-batches (m >= P); never with fewer ranks (m = 3P).
    def ratio(p: int, m: int) -> float:
        return rank_activation_peak(V_SCHEDULES[name](p, m)) / rank_activation_peak(
            one_f_one_b(p, m)
        )

    assert rank_activation_peak(V_SCHEDULES[name](p, m)) == peak
    assert ratio(p, m) <= target < ratio(p, m - 1)
    assert all(ratio(q, 3 * q) > target for q in range(2, p))


@pytest.mark.parametrize(("p", "m"), [(4, 8), (4, 16), (8, 16), (8, 32)])
def test_v_half_and_v_min_bubbles_stay_within_the_papers(p: int, m: int) -> None:
    # Bubble rate 1 - busy/period of back-to-back steps: V-Half about P/2m, V-Min 2P/3m.
    costs = ActionCosts(forward=1, input_grad=1, weight_grad=1)
    for schedule, bound in ((v_half(p, m), p / (2 * m)), (v_min(p, m), 2 * p / (3 * m))):
        idle, busy = steady_state_bubble(schedule, costs), 6 * m
        assert idle / (busy + idle) <= bound


@pytest.mark.parametrize(("p", "m"), [(4, 8), (4, 16)])
def test_v_half_and_v_min_single_steps_idle_less_than_1f1b(p: int, m: int) -> None:
    base = simulate(one_f_one_b(p, m), UNIFORM).bubble
    assert simulate(v_half(p, m), UNIFORM).bubble < base
    assert simulate(v_min(p, m), UNIFORM).bubble < base


def test_make_schedule_builds_the_v_schedules_with_two_stages_per_rank() -> None:
    schedule = make_schedule("v_min", num_ranks=3, micro_batches=6, stages_per_rank=2)
    assert (schedule.name, schedule.num_stages) == ("v_min", 6)


def test_a_v_schedule_with_another_stage_count_says_to_give_two() -> None:
    with pytest.raises(ValueError, match="two stages per rank.*--stages-per-rank 2"):
        make_schedule("zb_v", num_ranks=2, micro_batches=4)


def test_a_v_schedule_under_the_loop_placement_is_refused() -> None:
    with pytest.raises(ValueError, match="'zb_v' orders its actions for the v placement"):
        make_schedule("zb_v", num_ranks=2, micro_batches=4, stages_per_rank=2, placement="loop")


def test_interleaved_under_the_v_placement_is_refused() -> None:
    with pytest.raises(ValueError, match="cannot run under --placement v"):
        make_schedule(
            "interleaved_1f1b", num_ranks=2, micro_batches=4, stages_per_rank=2, placement="v"
        )


def test_looped_bfs_runs_under_the_v_placement() -> None:
    schedule = make_schedule(
        "looped_bfs", num_ranks=2, micro_batches=2, stages_per_rank=2, placement="v"
    )
    assert schedule.placement == (0, 1, 1, 0)
    assert rows(schedule) == ["0F0 0F1 3F0 3F1 3B0 3B1 0B0 0B1", "1F0 1F1 2F0 2F1 2B0 2B1 1B0 1B1"]
    validate(schedule)


def test_with_placement_goes_back_and_forth() -> None:
    loop = looped_bfs(3, 2, 2)
    there = with_placement(loop, "v")
    assert placement_name(there) == "v"
    assert with_placement(there, "loop") == loop


def test_an_unknown_placement_is_refused_naming_the_choices() -> None:
    with pytest.raises(ValueError, match="unknown placement 'w': choose one of loop, v"):
        make_schedule("looped_bfs", num_ranks=2, micro_batches=2, stages_per_rank=2, placement="w")
    with pytest.raises(ValueError, match="placement='w': choose one of loop, v"):
        ScheduleConfig(placement="w")


def test_schedule_config_resolves_its_placement() -> None:
    config = ScheduleConfig(
        schedule="looped_bfs", micro_batches=2, stages_per_rank=2, placement="v"
    )
    assert config.resolve(2).placement == (0, 1, 1, 0)
    assert PLACEMENTS == ("loop", "v")
