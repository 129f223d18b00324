"""What the stage exchange holds while a rank walks its schedule's row: a send is held until a
receive proves it delivered (`released_at`): an output sent forward until its gradient comes
back, an input gradient sent back until its peer's next message to this rank arrives; the
rest until the step's end."""

from __future__ import annotations

import torch
import torch.distributed as dist

from engine.comm.p2p import StageExchange
from engine.schedule import add_communication, make_schedule
from engine.schedule.actions import ActionKind
from engine.schedule.delivery import released_at
from engine.schedule.passes import peer_stage
from tests.dist.harness import run_ranks


def _walk(rank: int, world_size: int, name: str, v: int) -> list[tuple[str, tuple[str, ...]]]:
    """Every send and receive of this rank's row (compute skipped); after each receive, the
    sends still held."""
    dist.init_process_group("gloo")
    schedule = add_communication(
        make_schedule(name, num_ranks=world_size, micro_batches=4, stages_per_rank=v)
    )
    edges = [(s, s + d) for s in range(schedule.num_stages) for d in (1, -1)]
    groups = {e: dist.new_group([0, 1]) for e in edges if 0 <= e[1] < schedule.num_stages}
    exchange = StageExchange(
        groups=groups,
        global_rank_of_stage=dict(enumerate(schedule.placement)),
        device=torch.device("cpu"),
        timeout_s=60,
    )
    releases = released_at(schedule, rank)
    held: list[tuple[str, tuple[str, ...]]] = []
    for action in schedule.rows[rank]:
        if action.kind in (ActionKind.SEND_F, ActionKind.SEND_B):
            exchange.send(action, (torch.full((2, 3), float(action.stage)),), training=True)
        elif action.kind in (ActionKind.RECV_F, ActionKind.RECV_B):
            (x,) = exchange.recv(action, training=True)
            assert torch.equal(x, torch.full((2, 3), float(peer_stage(action))))
            exchange.release(releases.get(action, ()))
            held.append((str(action), tuple(str(a) for a in exchange.unsettled_sends)))
    exchange.wait_sends()
    held.append(("step end", tuple(str(a) for a in exchange.unsettled_sends)))
    return held


def test_1f1b_holds_an_output_until_its_gradient_and_a_gradient_until_the_next_input() -> None:
    ranks = run_ranks(_walk, 2, "1f1b", 1, timeout_s=120)
    assert ranks[0] == [
        ("0RECV_B0", ("0SEND_F1",)),
        ("0RECV_B1", ("0SEND_F2",)),
        ("0RECV_B2", ("0SEND_F3",)),
        ("0RECV_B3", ()),
        ("step end", ()),
    ]
    assert ranks[1] == [
        ("1RECV_F0", ()),
        ("1RECV_F1", ("1SEND_B0",)),
        ("1RECV_F2", ("1SEND_B1",)),
        ("1RECV_F3", ("1SEND_B2",)),
        ("step end", ()),
    ]


def test_a_v_rank_holds_one_send_at_a_time() -> None:
    ranks = run_ranks(_walk, 2, "v_min", 2, timeout_s=120)
    assert ranks[0] == [
        ("3RECV_F0", ("0SEND_F0",)),
        ("0RECV_B0", ("0SEND_F1",)),  # 0SEND_F0 and 3SEND_B0 proved delivered
        ("3RECV_F1", ("0SEND_F1",)),
        ("0RECV_B1", ("0SEND_F2",)),
        ("3RECV_F2", ("0SEND_F2",)),
        ("0RECV_B2", ("0SEND_F3",)),
        ("3RECV_F3", ("0SEND_F3",)),
        ("0RECV_B3", ()),
        ("step end", ()),
    ]
    assert ranks[1] == [
        ("1RECV_F0", ()),
        ("2RECV_B0", ()),
        ("1RECV_F1", ("1SEND_B0",)),
        ("2RECV_B1", ()),
        ("1RECV_F2", ("1SEND_B1",)),
        ("2RECV_B2", ()),
        ("1RECV_F3", ("1SEND_B2",)),
        ("2RECV_B3", ()),
        ("step end", ()),  # 1SEND_B3 follows the row's last receive: awaited here
    ]
