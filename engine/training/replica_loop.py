"""What a fault-tolerant replica (`--fault-tolerant`) heals with, and how it says so.

Each step begins with the replica group's quorum. A replica behind the quorum (relaunched
after a dead rank) first receives, rank by rank, the weights, optimizer, scheduler and loss
scale state of the same rank of a live replica, and jumps to the quorum's step: the steps
it missed are counted and reported. The gradients are then averaged over the quorum's
replicas (the engine's dp exchange goes through torchft), and the optimizer steps only if
torchft commits the step; a step it refuses (a peer died during it) runs again under the
next quorum, without that peer (`engine.training.loop`). Only replica 0 writes checkpoints
and metrics.
"""

from __future__ import annotations

from typing import Any

from torch.optim.lr_scheduler import LRScheduler

from engine.comm.replica_group import ReplicaGroup
from engine.runtime.engine import PipelineEngine

__all__ = ["heal_state", "rejoin_note"]


def heal_state(engine: PipelineEngine, scheduler: LRScheduler, replicas: ReplicaGroup) -> None:
    """Register what a live replica's rank sends the same rank of a healing replica."""
    assert engine.optimizer is not None
    optimizer = engine.optimizer

    def save() -> dict[str, Any]:
        return {
            "model": engine.module.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "scaler": engine.scaler.state_dict() if engine.scaler is not None else {},
            "skipped_steps": engine.skipped_steps,
        }

    def load(state: dict[str, Any]) -> None:
        engine.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        if engine.scaler is not None and state["scaler"]:
            engine.scaler.load_state_dict(state["scaler"])
        engine.skipped_steps = state["skipped_steps"]

    replicas.register_state(load, save)


def rejoin_note(replicas: ReplicaGroup) -> str:
    """ "replica 1 rejoined at step 8 …: it missed 4 steps (4 to 7)"."""
    assert replicas.healed is not None
    after = replicas.healed[1]
    missed = replicas.missed_steps
    lost = (
        f"it missed {missed} steps ({after - missed + 1} to {after}, trained without it)"
        if missed
        else "it missed no step (the live replicas committed none without it)"
    )
    return (
        f"replica {replicas.place.replica} rejoined at step {after + 1} with a live replica's "
        f"weights and optimizer state: {lost}"
    )
