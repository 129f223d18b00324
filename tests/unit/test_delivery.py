"""When a schedule proves a send delivered (`engine.schedule.delivery`): the rank may free it
at that receive instead of holding it to the step's end."""

from __future__ import annotations

import pickle

import pytest

from engine.schedule import (
    SCHEDULES,
    V_SCHEDULES,
    VIRTUAL_SCHEDULES,
    Schedule,
    add_communication,
    make_schedule,
    parse_schedule,
)
from engine.schedule.actions import ActionKind, format_actions
from engine.schedule.delivery import held_input_gradients, released_at
from engine.schedule.passes import counterpart, peer_of


def _lowered(name: str, pp: int, m: int) -> Schedule:
    v = 2 if name in VIRTUAL_SCHEDULES or name in V_SCHEDULES else 1
    return add_communication(make_schedule(name, num_ranks=pp, micro_batches=m, stages_per_rank=v))


def _text(releases: dict) -> dict[str, str]:
    return {str(recv): format_actions(sends) for recv, sends in releases.items()}


def test_1f1b_frees_an_output_at_its_gradient_and_a_gradient_at_the_next_input() -> None:
    schedule = _lowered("1f1b", 2, 4)
    assert _text(released_at(schedule, 0)) == {f"0RECV_B{k}": f"0SEND_F{k}" for k in range(4)}
    # rank 0 sends micro-batch k + 2 forward only after it received gradient k
    assert _text(released_at(schedule, 1)) == {"1RECV_F2": "1SEND_B0", "1RECV_F3": "1SEND_B1"}


def test_a_send_its_peer_answers_nothing_after_is_held_to_the_step_end() -> None:
    rows = ["0F0 0SEND_F0 0RECV_B0 0B0", "1RECV_F0 1F0 1B0 1SEND_B0"]
    schedule = parse_schedule(rows, micro_batches=1)
    assert _text(released_at(schedule, 0)) == {"0RECV_B0": "0SEND_F0"}
    assert released_at(schedule, 1) == {}


@pytest.mark.parametrize("name", sorted(SCHEDULES))
@pytest.mark.parametrize(("pp", "m"), [(2, 4), (3, 6), (4, 8)])
def test_every_release_follows_from_the_peers_row(name: str, pp: int, m: int) -> None:
    """Each released send was posted earlier in the row, and the proof is a message its peer
    sends after it received the send (for an output: the gradient computed from it)."""
    schedule = _lowered(name, pp, m)
    for rank, row in enumerate(schedule.rows):
        index = {a: i for i, a in enumerate(row)}
        for proof, sends in released_at(schedule, rank).items():
            peer_row = schedule.rows[peer_of(proof, schedule)]
            posted = peer_row.index(counterpart(proof))
            for send in sends:
                assert index[send] < index[proof]
                assert peer_row.index(counterpart(send)) < posted
                assert peer_of(send, schedule) == peer_of(proof, schedule)


def test_1f1b_holds_two_gradients_sent_back_at_most_whatever_the_micro_batches() -> None:
    assert held_input_gradients(_lowered("1f1b", 2, 4)) == (0, 2)
    assert held_input_gradients(_lowered("1f1b", 2, 16)) == (0, 2)


def test_gpipe_holds_every_gradient_sent_back() -> None:
    """Its forwards all run first, so no message follows a gradient's arrival."""
    assert held_input_gradients(_lowered("gpipe", 3, 6)) == (0, 6, 6)


def test_a_v_rank_holds_at_most_two_gradients_sent_back_per_stage() -> None:
    held = held_input_gradients(_lowered("v_min", 4, 16))
    assert max(held) <= 2 < 16
    assert held[0] == held[4] == 0  # stage 0 sends none back; stage 4's previous is on its rank


def test_only_sends_are_released() -> None:
    schedule = _lowered("zb_h1", 3, 6)
    kinds = {
        send.kind
        for rank in range(3)
        for sends in released_at(schedule, rank).values()
        for send in sends
    }
    assert kinds == {ActionKind.SEND_F, ActionKind.SEND_B}


def _held_by_walking_the_lowered_rows(schedule: Schedule) -> tuple[int, ...]:
    """The definition: +1 at each SEND_B, -1 at the receive `released_at` names for it."""
    most = [0] * schedule.num_stages
    for rank, row in enumerate(schedule.rows):
        releases, held = released_at(schedule, rank), [0] * schedule.num_stages
        for action in row:
            for sent in releases.get(action, ()):
                held[sent.stage] -= sent.kind is ActionKind.SEND_B
            if action.kind is ActionKind.SEND_B:
                held[action.stage] += 1
                most[action.stage] = max(most[action.stage], held[action.stage])
    return tuple(most)


@pytest.mark.parametrize("name", sorted(SCHEDULES))
@pytest.mark.parametrize(("pp", "m"), [(2, 4), (3, 6), (4, 8), (4, 16)])
def test_the_held_count_from_compute_actions_equals_walking_the_lowered_rows(
    name: str, pp: int, m: int
) -> None:
    if name == "dualpipe_v" and m < 2 * pp:
        pytest.skip("dualpipe_v needs m >= 2pp")
    lowered = _lowered(name, pp, m)
    compute_only = make_schedule(
        name, num_ranks=pp, micro_batches=m, stages_per_rank=2 if lowered.num_stages > pp else 1
    )
    assert held_input_gradients(compute_only) == _held_by_walking_the_lowered_rows(lowered)
    assert held_input_gradients(lowered) == held_input_gradients(compute_only)


def test_a_pickled_schedule_leaves_its_cached_hash_behind() -> None:
    """str hashes differ between processes: a schedule sent to a rank hashes afresh there."""
    schedule = _lowered("1f1b", 2, 4)
    hash(schedule)
    copy = pickle.loads(pickle.dumps(schedule))
    assert "_hash" not in copy.__dict__
    assert copy == schedule and hash(copy) == hash(schedule)
