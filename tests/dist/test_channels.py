"""Every message the pipeline sends is one NCCL would deliver: NCCL matches a communicator's
sends and receives between two ranks by issue order (tags are ignored) and a send blocks its
rank pair's stream until the receive runs. These ranks run on gloo but record every p2p call,
and the tests check the recorded traffic against NCCL's rules.
"""

from __future__ import annotations

import contextlib
import inspect
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from engine.comm.mesh import init_mesh
from engine.config import OptimizerSpec
from engine.runtime.engine import PipelineEngine
from models import layer_specs
from partitioners import partition_model
from tests.dist.cases import GPT_UNTIED
from tests.dist.harness import run_ranks

SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("zb_drain", 1), ("interleaved_1f1b", 2))
Record = tuple[str, str, int, int, tuple[int, ...], str, bool]
"""(group name, "send" or "recv", this rank, peer rank, shape, dtype, inside a batch)."""


@contextlib.contextmanager
def _recorded(log: list[Record]) -> Iterator[None]:
    """Wrap torch's isend/irecv (and the batch call) so each call is logged, then run."""
    originals = c10d.isend, c10d.irecv, c10d.batch_isend_irecv
    batched = [False]

    def wrap(kind: str, fn: Any) -> Any:
        signature = inspect.signature(fn)

        def call(*args: Any, **kwargs: Any) -> Any:
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            arg = bound.arguments
            group = arg["group"] or c10d._get_default_group()
            peer = arg["dst" if kind == "send" else "src"]
            local = arg["group_dst" if kind == "send" else "group_src"]
            if local is not None:  # batch_isend_irecv names the peer by its rank in the group
                peer = c10d.get_global_rank(group, local)
            tensor, me = arg["tensor"], dist.get_rank()
            log.append(
                (
                    group.group_name,
                    kind,
                    me,
                    peer,
                    tuple(tensor.shape),
                    str(tensor.dtype),
                    batched[0],
                )
            )
            return fn(*args, **kwargs)

        return call

    def batch(ops: list[dist.P2POp]) -> Any:
        batched[0] = True
        try:
            return originals[2](ops)
        finally:
            batched[0] = False

    isend, irecv = wrap("send", originals[0]), wrap("recv", originals[1])
    for module in (c10d, dist):
        module.isend, module.irecv, module.batch_isend_irecv = isend, irecv, batch  # type: ignore[attr-defined]
    try:
        yield
    finally:
        for module in (c10d, dist):
            module.isend, module.irecv, module.batch_isend_irecv = originals  # type: ignore[attr-defined]


def _traffic(rank: int, world_size: int) -> dict[str, Any]:
    """Two training steps and an eval step of each schedule, every p2p call recorded."""
    mesh = init_mesh(world_size, 1, timeout_s=60)
    specs = layer_specs(GPT_UNTIED)
    out: dict[str, Any] = {}
    for schedule, v in SCHEDULES:
        log: list[Record] = []
        with _recorded(log):
            partition = partition_model(
                specs, method="uniform", num_stages=world_size * v, seq_len=16
            )
            engine = PipelineEngine(
                specs, mesh, partition=partition, micro_batches=6, schedule=schedule,
                stages_per_rank=v, optimizer=OptimizerSpec(lr=1e-3), timeout_s=60,
            )  # fmt: skip
            tokens = torch.randint(0, 256, (12, 17), generator=torch.Generator().manual_seed(0))
            x, y = tokens[:, :-1], tokens[:, 1:]
            for _ in range(2):
                engine.train_step(x if engine.is_first else None, y if engine.is_last else None)
            engine.eval_step(x if engine.is_first else None, y if engine.is_last else None)
        edges = {group.group_name for group in engine.channels.edges.values()}
        out[schedule] = {"log": log, "edge_groups": edges}
    return out


@pytest.fixture(scope="module")
def traffic() -> dict[str, list[dict[str, Any]]]:
    per_rank = run_ranks(_traffic, 3)
    return {schedule: [rank[schedule] for rank in per_rank] for schedule, _ in SCHEDULES}


@pytest.mark.parametrize("schedule", [name for name, _ in SCHEDULES])
def test_each_sender_and_receiver_pair_sees_the_same_messages_in_the_same_order(
    schedule: str, traffic: dict[str, list[dict[str, Any]]]
) -> None:
    sent: dict[tuple[str, int, int], list[tuple[Any, ...]]] = defaultdict(list)
    received: dict[tuple[str, int, int], list[tuple[Any, ...]]] = defaultdict(list)
    for rank in traffic[schedule]:
        for group, kind, me, peer, shape, dtype, _ in rank["log"]:
            if kind == "send":
                sent[(group, me, peer)].append((shape, dtype))
            else:
                received[(group, peer, me)].append((shape, dtype))
    assert sent and sent == received


@pytest.mark.parametrize("schedule", [name for name, _ in SCHEDULES])
def test_each_activation_and_gradient_edge_has_its_own_one_way_group(
    schedule: str, traffic: dict[str, list[dict[str, Any]]]
) -> None:
    ends: dict[str, set[tuple[str, int]]] = defaultdict(set)
    for rank in traffic[schedule]:
        for group, kind, me, _, _, _, _ in rank["log"]:
            if group in rank["edge_groups"]:
                ends[group].add((kind, me))
    assert ends
    for group, seen in ends.items():
        assert sorted(kind for kind, _ in seen) == ["recv", "send"], (group, seen)


@pytest.mark.parametrize("schedule", [name for name, _ in SCHEDULES])
def test_no_rank_both_sends_to_and_receives_from_a_peer_outside_a_batch(
    schedule: str, traffic: dict[str, list[dict[str, Any]]]
) -> None:
    """An unbatched send queued behind a receive from the same peer on the same group could
    wait forever under NCCL; the step figures, exchanged both ways, go as one batch."""
    kinds: dict[tuple[str, int, int], set[str]] = defaultdict(set)
    for rank in traffic[schedule]:
        for group, kind, me, peer, _, _, batched in rank["log"]:
            if not batched:
                kinds[(group, me, peer)].add(kind)
    assert all(len(seen) == 1 for seen in kinds.values()), kinds
