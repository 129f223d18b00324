"""Schedules and their lowering as data: literal tables of the text form, one behaviour per test."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from engine.schedule.actions import Action, ActionKind, format_actions, parse_action
from engine.schedule.generators import SCHEDULES, gpipe, make_schedule, one_f_one_b
from engine.schedule.passes import add_communication, counterpart, is_lowered, peer_of, peer_stage
from engine.schedule.schedule import Schedule, format_schedule
from engine.schedule.text import parse_schedule

Generator = Callable[[int, int], Schedule]


def _rows(schedule: Schedule) -> list[str]:
    return [format_actions(row) for row in schedule.rows]


# --- generators ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("generator", "num_ranks", "micro_batches", "rows"),
    [
        (gpipe, 1, 2, ["0F0 0F1 0B0 0B1"]),
        (gpipe, 2, 2, ["0F0 0F1 0B0 0B1", "1F0 1F1 1B0 1B1"]),
        (
            gpipe,
            3,
            3,
            ["0F0 0F1 0F2 0B0 0B1 0B2", "1F0 1F1 1F2 1B0 1B1 1B2", "2F0 2F1 2F2 2B0 2B1 2B2"],
        ),
        (one_f_one_b, 1, 3, ["0F0 0B0 0F1 0B1 0F2 0B2"]),
        (one_f_one_b, 2, 3, ["0F0 0F1 0B0 0F2 0B1 0B2", "1F0 1B0 1F1 1B1 1F2 1B2"]),
        (
            one_f_one_b,
            3,
            4,
            [
                "0F0 0F1 0F2 0B0 0F3 0B1 0B2 0B3",
                "1F0 1F1 1B0 1F2 1B1 1F3 1B2 1B3",
                "2F0 2B0 2F1 2B1 2F2 2B2 2F3 2B3",
            ],
        ),
        (
            one_f_one_b,
            4,
            2,
            ["0F0 0F1 0B0 0B1", "1F0 1F1 1B0 1B1", "2F0 2F1 2B0 2B1", "3F0 3B0 3F1 3B1"],
        ),
        (one_f_one_b, 3, 1, ["0F0 0B0", "1F0 1B0", "2F0 2B0"]),
    ],
)
def test_generator_rows(
    generator: Generator, num_ranks: int, micro_batches: int, rows: list[str]
) -> None:
    assert _rows(generator(num_ranks, micro_batches)) == rows


@pytest.mark.parametrize("generator", [gpipe, one_f_one_b])
def test_generators_put_stage_s_on_rank_s(generator: Generator) -> None:
    schedule = generator(3, 4)
    assert (schedule.num_ranks, schedule.num_stages, schedule.micro_batches) == (3, 3, 4)
    assert schedule.placement == (0, 1, 2)
    assert [schedule.stages_of(r) for r in range(3)] == [(0,), (1,), (2,)]
    assert not schedule.lowered


@pytest.mark.parametrize("generator", [gpipe, one_f_one_b])
@pytest.mark.parametrize("num_ranks", [1, 2, 3, 4])
@pytest.mark.parametrize("micro_batches", [1, 2, 3, 5, 8])
def test_every_stage_runs_its_backwards_in_micro_batch_order(
    generator: Generator, num_ranks: int, micro_batches: int
) -> None:
    # Gradient accumulation order must match the single-process reference bit for bit.
    for row in generator(num_ranks, micro_batches).rows:
        for kind in (ActionKind.F, ActionKind.B):
            assert [a.micro_batch for a in row if a.kind is kind] == list(range(micro_batches))


@pytest.mark.parametrize(
    ("num_ranks", "micro_batches", "forwards"),
    [(4, 8, [4, 3, 2, 1]), (4, 2, [2, 2, 2, 1]), (2, 1, [1, 1]), (1, 4, [1])],
)
def test_one_f_one_b_runs_min_of_p_minus_r_and_m_forwards_before_its_first_backward(
    num_ranks: int, micro_batches: int, forwards: list[int]
) -> None:
    schedule = one_f_one_b(num_ranks, micro_batches)
    kinds = [[a.kind for a in row] for row in schedule.rows]
    assert [row.index(ActionKind.B) for row in kinds] == forwards


def test_schedules_registry_names_the_generators() -> None:
    assert SCHEDULES["gpipe"] is gpipe and SCHEDULES["1f1b"] is one_f_one_b
    assert set(SCHEDULES) == {
        "gpipe",
        "1f1b",
        "interleaved_1f1b",
        "looped_bfs",
        "zb_h1",
        "zb_h2",
        "zb_drain",
        "zb_v",
        "v_half",
        "v_min",
        "dualpipe_v",
    }


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_make_schedule_builds_the_named_generator(name: str) -> None:
    assert make_schedule(name, num_ranks=3, micro_batches=5) == SCHEDULES[name](3, 5)


def test_make_schedule_rejects_an_unknown_name_listing_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown schedule 'zb': choose one of gpipe, 1f1b"):
        make_schedule("zb", num_ranks=2, micro_batches=2)


@pytest.mark.parametrize(
    ("num_ranks", "micro_batches", "message"),
    [(0, 4, r"num_ranks=0: .* at least 1 rank"), (2, 0, r"micro_batches=0: .* at least 1")],
)
def test_make_schedule_rejects_sizes_below_one(
    num_ranks: int, micro_batches: int, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        make_schedule("1f1b", num_ranks=num_ranks, micro_batches=micro_batches)


@pytest.mark.parametrize(
    ("rows", "placement", "message"),
    [
        (["0F0 0B0"], (0, 1), "placement .* names ranks \\[1\\] outside 0..0"),
        (["0F0 0B0"], (), "needs num_ranks, num_stages, micro_batches >= 1"),
    ],
)
def test_schedule_rejects_a_placement_that_does_not_fit_its_ranks(
    rows: list[str], placement: tuple[int, ...], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        parse_schedule(rows, micro_batches=1, placement=placement)


def test_schedule_needs_one_row_per_rank() -> None:
    with pytest.raises(ValueError, match="1 rows for 2 ranks"):
        Schedule(
            name="custom",
            num_ranks=2,
            num_stages=2,
            micro_batches=1,
            placement=(0, 1),
            rows=((parse_action("0F0"),),),
        )


def test_parse_schedule_reads_back_the_text_form() -> None:
    schedule = one_f_one_b(3, 4)
    parsed = parse_schedule(_rows(schedule), micro_batches=4, name="1f1b")
    assert parsed == schedule


def test_parse_schedule_marks_rows_with_sends_as_lowered() -> None:
    parsed = parse_schedule(
        ["0F0 0SEND_F0 0RECV_B0 0B0", "1RECV_F0 1F0 1B0 1SEND_B0"], micro_batches=1
    )
    assert parsed.lowered


# --- format_schedule ----------------------------------------------------------------------------


def test_format_schedule_writes_one_line_per_rank() -> None:
    assert format_schedule(one_f_one_b(2, 3)).splitlines() == [
        "rank 0: 0F0 0F1 0B0 0F2 0B1 0B2",
        "rank 1: 1F0 1B0 1F1 1B1 1F2 1B2",
    ]


def test_str_of_a_schedule_is_its_grid() -> None:
    assert str(gpipe(2, 1)) == "rank 0: 0F0 0B0\nrank 1: 1F0 1B0"


def test_format_schedule_around_shows_a_window_and_marks_the_action() -> None:
    text = format_schedule(one_f_one_b(2, 8), around=(1, 5), width=4)
    assert text.splitlines() == [
        "rank 0: … 0F2 0B1 0F3 0B2 …",
        "rank 1: … 1B1 1F2 >>1B2<< 1F3 …",
    ]


def test_format_schedule_around_the_start_has_no_leading_ellipsis() -> None:
    text = format_schedule(gpipe(2, 4), around=(0, 0), width=3)
    assert text.splitlines() == [
        "rank 0: >>0F0<< 0F1 0F2 …",
        "rank 1: 1F0 1F1 1F2 …",
    ]


def test_format_schedule_aligns_rank_labels() -> None:
    lines = format_schedule(gpipe(11, 1)).splitlines()
    assert lines[0] == "rank  0: 0F0 0B0"
    assert lines[10] == "rank 10: 10F0 10B0"


def test_format_schedule_rejects_a_rank_outside_the_schedule() -> None:
    with pytest.raises(ValueError, match=r"around=\(2, 0\): rank must be in 0..1"):
        format_schedule(gpipe(2, 2), around=(2, 0))


# --- lowering: add_communication ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("schedule", "rows"),
    [
        (
            one_f_one_b(2, 2),
            [
                "0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1",
                "1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1",
            ],
        ),
        (
            gpipe(3, 1),
            [
                "0F0 0SEND_F0 0RECV_B0 0B0",
                "1RECV_F0 1F0 1SEND_F0 1RECV_B0 1B0 1SEND_B0",
                "2RECV_F0 2F0 2B0 2SEND_B0",
            ],
        ),
        (gpipe(1, 2), ["0F0 0F1 0B0 0B1"]),
    ],
)
def test_add_communication_rows(schedule: Schedule, rows: list[str]) -> None:
    assert _rows(add_communication(schedule)) == rows


def test_add_communication_sends_b_gradients_around_i_and_keeps_w_local() -> None:
    split = parse_schedule(["0F0 0I0 0W0", "1F0 1I0 1W0"], micro_batches=1)
    assert _rows(add_communication(split)) == [
        "0F0 0SEND_F0 0RECV_B0 0I0 0W0",
        "1RECV_F0 1F0 1I0 1SEND_B0 1W0",
    ]


def test_add_communication_follows_placement_not_stage_equals_rank() -> None:
    # Three stages on two ranks (stage 2 back on rank 0): neighbours on other ranks exchange.
    looped = parse_schedule(["0F0 2F0 2B0 0B0", "1F0 1B0"], micro_batches=1, placement=(0, 1, 0))
    assert _rows(add_communication(looped)) == [
        "0F0 0SEND_F0 2RECV_F0 2F0 2B0 2SEND_B0 0RECV_B0 0B0",
        "1RECV_F0 1F0 1SEND_F0 1RECV_B0 1B0 1SEND_B0",
    ]


def test_add_communication_skips_neighbours_on_the_same_rank() -> None:
    both_local = parse_schedule(["0F0 1F0 1B0 0B0"], micro_batches=1, placement=(0, 0))
    assert _rows(add_communication(both_local)) == ["0F0 1F0 1B0 0B0"]


def test_add_communication_keeps_everything_but_the_rows() -> None:
    lowered = add_communication(one_f_one_b(3, 4))
    assert lowered.lowered
    assert (lowered.name, lowered.placement, lowered.micro_batches) == ("1f1b", (0, 1, 2), 4)


def test_lowering_twice_is_an_error() -> None:
    with pytest.raises(ValueError, match="already lowered"):
        add_communication(add_communication(gpipe(2, 2)))


def test_lowering_a_single_rank_schedule_twice_is_an_error_too() -> None:
    # No sends get added on one rank, so only the flag tells that it was lowered.
    with pytest.raises(ValueError, match="already lowered"):
        add_communication(add_communication(gpipe(1, 2)))


def test_is_lowered() -> None:
    assert not is_lowered(gpipe(2, 2))
    assert is_lowered(add_communication(gpipe(2, 2)))


@pytest.mark.parametrize(
    ("token", "stage", "match"),
    [
        ("1SEND_F3", 2, "2RECV_F3"),
        ("2RECV_F3", 1, "1SEND_F3"),
        ("2SEND_B0", 1, "1RECV_B0"),
        ("1RECV_B0", 2, "2SEND_B0"),
    ],
)
def test_peer_stage_and_counterpart(token: str, stage: int, match: str) -> None:
    action = parse_action(token)
    assert peer_stage(action) == stage
    assert counterpart(action) == parse_action(match)


def test_peer_of_uses_the_placement() -> None:
    looped = parse_schedule(["0F0 2F0 2B0 0B0", "1F0 1B0"], micro_batches=1, placement=(0, 1, 0))
    assert peer_of(parse_action("1SEND_F0"), looped) == 0
    assert peer_of(parse_action("2RECV_F0"), looped) == 1


@pytest.mark.parametrize(
    ("token", "side"),
    [("0RECV_F0", "previous stage -1"), ("1SEND_F0", "next stage 2"), ("1RECV_B0", "next stage 2")],
)
def test_peer_of_an_exchange_past_the_first_or_last_stage_is_an_error(
    token: str, side: str
) -> None:
    with pytest.raises(ValueError, match=rf"{token} has no peer: stage \d has no {side}"):
        peer_of(parse_action(token), gpipe(2, 2))


def test_counterpart_of_an_exchange_before_stage_0_is_an_error() -> None:
    with pytest.raises(ValueError, match="0RECV_F0 has no peer: stage 0 has no previous stage"):
        counterpart(parse_action("0RECV_F0"))


def test_counterpart_given_the_stage_count_rejects_a_peer_past_the_last_stage() -> None:
    with pytest.raises(ValueError, match="1SEND_F0 has no peer: stage 1 has no next stage 2"):
        counterpart(parse_action("1SEND_F0"), num_stages=2)


def test_peer_stage_of_a_compute_action_is_an_error() -> None:
    with pytest.raises(ValueError, match="1F0 is a compute action"):
        peer_stage(Action(1, ActionKind.F, 0))


def test_the_forward_only_schedule_is_named_as_evals_not_as_unknown() -> None:
    with pytest.raises(ValueError, match="'inference' runs forwards only: every engine's eval"):
        make_schedule("inference", num_ranks=2, micro_batches=2)
