"""Interleaved, looped BFS and zero-bubble schedules: literal tables, validity, closed forms."""

from __future__ import annotations

import itertools

import pytest

from engine.schedule.actions import ActionKind, format_actions
from engine.schedule.generators import (
    SCHEDULES,
    VIRTUAL_SCHEDULES,
    interleaved_1f1b,
    looped_bfs,
    make_schedule,
    one_f_one_b,
    zb_drain,
    zb_h1,
    zb_h2,
)
from engine.schedule.simulate import ActionCosts, repeat, simulate, steady_state_bubble
from engine.schedule.validate import validate

UNIT = ActionCosts(forward=1, backward=2, input_grad=1, weight_grad=1)


def rows(schedule: object) -> list[str]:
    return [format_actions(row) for row in schedule.rows]  # type: ignore[attr-defined]


def test_zb_h1_literal_table_for_two_ranks() -> None:
    # The first stage's W would follow its I at once (nobody waits for its input gradient):
    # it runs a fused B instead.
    assert rows(zb_h1(2, 3)) == [
        "0F0 0F1 0B0 0F2 0B1 0B2",
        "1F0 1I0 1F1 1I1 1W0 1F2 1I2 1W1 1W2",
    ]


def test_zb_h2_literal_table_for_two_ranks() -> None:
    assert rows(zb_h2(2, 4)) == [
        "0F0 0F1 0F2 0B0 0F3 0B1 0B2 0B3",
        "1F0 1I0 1F1 1I1 1F2 1I2 1W0 1F3 1I3 1W1 1W2 1W3",
    ]


def test_zb_drain_literal_table_splits_only_the_drain() -> None:
    assert rows(zb_drain(2, 8)) == [
        "0F0 0F1 0F2 0B0 0F3 0B1 0F4 0B2 0F5 0B3 0F6 0B4 0F7 0B5 0B6 0B7",
        "1F0 1B0 1F1 1B1 1F2 1B2 1F3 1B3 1F4 1B4 1F5 1I5 1F6 1I6 1F7 1I7 1W5 1W6 1W7",
    ]


def test_zb_drain_splits_the_last_3r_micro_batches_of_rank_r() -> None:
    schedule = zb_drain(4, 8)
    for rank, row in enumerate(schedule.rows):
        split = sorted(a.micro_batch for a in row if a.kind is ActionKind.I)
        assert split == list(range(8 - min(8, 3 * rank), 8))


@pytest.mark.parametrize(("p", "m"), [(2, 8), (2, 16), (3, 12)])
def test_zb_drain_back_to_back_beats_zb_h2_when_a_split_costs_more_than_b(p: int, m: int) -> None:
    costs = ActionCosts(forward=40, backward=66, input_grad=45, weight_grad=30)
    period = {
        name: simulate(repeat(s, 4), costs).step_time - simulate(repeat(s, 3), costs).step_time
        for name, s in (("drain", zb_drain(p, m)), ("h2", zb_h2(p, m)))
    }
    assert period["drain"] < period["h2"]


def test_interleaved_literal_table_places_stage_s_on_rank_s_mod_p() -> None:
    schedule = interleaved_1f1b(2, 2, 2)
    assert schedule.placement == (0, 1, 0, 1)
    assert rows(schedule) == [
        "0F0 0F1 2F0 2F1 2B0 2B1 0B0 0B1",
        "1F0 1F1 3F0 3F1 3B0 3B1 1B0 1B1",
    ]


def test_looped_bfs_runs_every_micro_batch_through_a_chunk_before_the_next() -> None:
    assert rows(looped_bfs(2, 2, 2))[0] == "0F0 0F1 2F0 2F1 2B0 2B1 0B0 0B1"


@pytest.mark.parametrize(
    ("name", "ranks", "m", "v"),
    [
        *(
            (n, p, m, 1)
            for n in ("zb_h1", "zb_h2", "zb_drain")
            for p in (1, 2, 3, 4)
            for m in range(1, 9)
        ),
        *(
            (n, p, m, v)
            for n in ("interleaved_1f1b", "looped_bfs")
            for p in (1, 2, 3, 4)
            for m in (p, 2 * p, 3 * p)
            for v in (1, 2, 3)
        ),
    ],
)
def test_every_generated_schedule_is_valid_and_deadlock_free(
    name: str, ranks: int, m: int, v: int
) -> None:
    virtual = name in VIRTUAL_SCHEDULES
    schedule = SCHEDULES[name](ranks, m, v) if virtual else SCHEDULES[name](ranks, m)
    validate(schedule)
    simulate(schedule)


@pytest.mark.parametrize(("name", "plain"), [("interleaved_1f1b", "1f1b"), ("looped_bfs", "gpipe")])
def test_a_virtual_schedule_with_one_stage_per_rank_points_to_its_plain_form(
    name: str, plain: str
) -> None:
    with pytest.raises(
        ValueError, match=f"give --stages-per-rank 2 or more, or use --schedule {plain}"
    ):
        make_schedule(name, num_ranks=2, micro_batches=4, stages_per_rank=1)


@pytest.mark.parametrize(("p", "v", "m"), list(itertools.product((2, 3, 4), (2, 3), (1, 2, 3))))
def test_interleaved_bubble_is_p_minus_1_over_vm_plus_p_minus_1(p: int, v: int, m: int) -> None:
    schedule = interleaved_1f1b(p, m * p, v)
    expected = (p - 1) / (v * m * p + p - 1)
    assert simulate(schedule, UNIT).bubble == pytest.approx(expected, rel=1e-12)


COSTS = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 0.5), (1.5, 1.5, 1)]


@pytest.mark.parametrize(("p", "costs"), list(itertools.product((2, 3, 4), COSTS)))
def test_zero_bubble_paper_table_2_bubble_sizes(p: int, costs: tuple[float, float, float]) -> None:
    """Steady state (steps back to back, as the paper runs them): 1F1B (P-1)(F+I+W),
    ZB-H1 (P-1)(F+I-W), ZB-H2 (P-1)(F+I-2W), for W no larger than F and I."""
    tf, ti, tw = costs
    c = ActionCosts(forward=tf, backward=ti + tw, input_grad=ti, weight_grad=tw)
    m = 3 * p
    assert steady_state_bubble(one_f_one_b(p, m), c) == pytest.approx((p - 1) * (tf + ti + tw))
    assert steady_state_bubble(zb_h1(p, m), c) == pytest.approx((p - 1) * (tf + ti - tw))
    assert steady_state_bubble(zb_h2(p, m), c) == pytest.approx((p - 1) * (tf + ti - 2 * tw))


@pytest.mark.parametrize("p", [2, 3, 4, 6])
def test_zero_bubble_peak_activations_are_p_and_2p_minus_1(p: int) -> None:
    m = 3 * p
    assert max(simulate(one_f_one_b(p, m), UNIT).activation_peak) == p
    assert simulate(zb_h1(p, m), UNIT).activation_peak == (p,) * p
    assert max(simulate(zb_h2(p, m), UNIT).activation_peak) == 2 * p - 1


@pytest.mark.parametrize("p", [2, 3, 4])
def test_zb_h1_with_a_step_barrier_loses_only_the_unavoidable_ramp(p: int) -> None:
    result = simulate(zb_h1(p, 2 * p), UNIT)
    assert all(result.step_time - busy == pytest.approx(p - 1) for busy in result.busy)


def test_interleaved_needs_micro_batches_in_groups_of_p() -> None:
    with pytest.raises(ValueError, match=r"multiple of the pipeline ranks \(m=5, P=2\): use m=4"):
        interleaved_1f1b(2, 5, 2)


def test_one_stage_schedules_reject_several_stages_per_rank() -> None:
    with pytest.raises(ValueError, match="'zb_h1' runs one stage per rank, not 2"):
        make_schedule("zb_h1", num_ranks=2, micro_batches=4, stages_per_rank=2)
