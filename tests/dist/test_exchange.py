"""What the stage exchange holds: a stage's output sent forward is held only until its
gradient comes back (the peer has used it), a gradient sent back until the step's end."""

from __future__ import annotations

import torch
import torch.distributed as dist

from engine.comm.p2p import StageExchange
from engine.schedule.actions import Action, ActionKind
from tests.dist.harness import run_ranks


def _two_micro_batches(rank: int, world_size: int) -> list[tuple[str, tuple[str, ...]]]:
    dist.init_process_group("gloo")
    world = dist.group.WORLD
    assert world is not None
    exchange = StageExchange(
        groups={(0, 1): world, (1, 0): world},
        global_rank_of_stage={0: 0, 1: 1},
        device=torch.device("cpu"),
        timeout_s=60,
    )
    held: list[tuple[str, tuple[str, ...]]] = []

    def note(event: str) -> None:
        held.append((event, tuple(str(a) for a in exchange.unsettled_sends)))

    if rank == 0:
        for k in (0, 1):
            output = (torch.full((2, 3), k + 1.0),)
            exchange.send(Action(0, ActionKind.SEND_F, k), output, training=True)
        note("sent 0 and 1")
        exchange.recv(Action(0, ActionKind.RECV_B, 0), training=True)
        note("gradient 0 arrived")
    else:
        for k in (0, 1):
            (x,) = exchange.recv(Action(1, ActionKind.RECV_F, k), training=True)
            assert torch.equal(x, torch.full((2, 3), k + 1.0))
        exchange.send(Action(1, ActionKind.SEND_B, 0), (torch.ones(2, 3),), training=True)
        note("sent gradient 0")
    exchange.wait_sends()
    note("step end")
    return held


def test_an_output_sent_forward_is_released_when_its_gradient_arrives() -> None:
    results = run_ranks(_two_micro_batches, 2, timeout_s=120)
    assert results[0] == [
        ("sent 0 and 1", ("0SEND_F0", "0SEND_F1")),
        ("gradient 0 arrived", ("0SEND_F1",)),
        ("step end", ()),
    ]
    assert results[1] == [("sent gradient 0", ("1SEND_B0",)), ("step end", ())]
