"""The process groups a pipeline talks over: one per direction of each cross-rank stage edge,
and one for the per-step reports.

NCCL ignores tags: it matches a communicator's sends and receives between two ranks in the
order they were issued, and runs them on one stream per rank pair, where a send blocks until
its receive runs. On a single pipeline group, 1F1B's activation going down and gradient coming
back would cross on that stream and deadlock, and any message posted in a different order
on the two ends (a receive posted ahead on another edge, the loss) would be matched with the
wrong one. Here every edge group has one sender and one receiver, and both walk the edge in
ascending micro-batch order (the validator demands it of every stage's forwards and
backwards, and each SEND/RECV sits next to its compute), so nothing can cross or be
mismatched, whatever the backend. Gloo gets the same groups, so CPU runs test the discipline
NCCL needs.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from engine.comm.mesh import Mesh
from engine.schedule.schedule import Schedule

__all__ = ["Edge", "PipelineChannels", "cross_rank_edges", "new_pipeline_channels"]

Edge = tuple[int, int]
"""(sending stage, receiving stage): (s, s + 1) carries activations, (s + 1, s) gradients."""


@dataclass(frozen=True)
class PipelineChannels:
    """This rank's groups: its edges' (only those it sends or receives on) and the reports'."""

    edges: dict[Edge, dist.ProcessGroup]
    reports: dist.ProcessGroup | None


def cross_rank_edges(schedule: Schedule) -> list[Edge]:
    """Both directions of every stage boundary whose stages live on different ranks."""
    edges: list[Edge] = []
    for s in range(schedule.num_stages - 1):
        if schedule.rank_of(s) != schedule.rank_of(s + 1):
            edges += [(s, s + 1), (s + 1, s)]
    return edges


def new_pipeline_channels(schedule: Schedule, mesh: Mesh, *, timeout_s: float) -> PipelineChannels:
    """Create the groups of every pipeline (one per (dp, tp) column of the grid); collective
    over the world.

    `new_group` must be called by every rank for every group in the same order, so each rank
    walks all columns and keeps the groups it belongs to. Each engine gets its own groups: a
    message an earlier engine left unread can never be taken by a later one.
    """
    if mesh.world_size == 1:
        return PipelineChannels(edges={}, reports=None)
    timeout = timedelta(seconds=timeout_s)
    edges: dict[Edge, dist.ProcessGroup] = {}
    reports: dist.ProcessGroup | None = None
    for replica, tp_rank in mesh.columns():
        for src, dst in cross_rank_edges(schedule):
            ranks = [
                mesh.global_rank(pp_rank=schedule.rank_of(s), dp_rank=replica, tp_rank=tp_rank)
                for s in (src, dst)
            ]
            group = dist.new_group(sorted(ranks), timeout=timeout)
            if mesh.rank in ranks:
                edges[(src, dst)] = group
        pipeline = [
            mesh.global_rank(pp_rank=r, dp_rank=replica, tp_rank=tp_rank) for r in range(mesh.pp)
        ]
        group = dist.new_group(pipeline, timeout=timeout)
        if mesh.rank in pipeline:
            reports = group
    return PipelineChannels(edges=edges, reports=reports)
