"""Replicas that survive a dead peer (`--fault-tolerant`): each pipeline replica is a torchft
replica group, and a per-step quorum from a Lighthouse decides which replicas sum gradients."""

from __future__ import annotations

from dataclasses import dataclass

from engine.config.fields import require

__all__ = ["FaultTolerance", "check_fault_tolerance"]


@dataclass(frozen=True, kw_only=True)
class FaultTolerance:
    """Whether the dp replicas run as torchft replica groups, and where their Lighthouse is.
    A dead rank then takes down only its replica; the others go on (the quorum shrinks), and
    the relaunched replica fetches the current weights and optimizer state from a live one."""

    fault_tolerant: bool = False
    """Run each pipeline replica as a torchft replica group: its dp gradient sum goes through
    torchft's managed process group under a per-step quorum, and the local launcher relaunches
    only the replica of a dead rank (--max-restarts times each)."""
    lighthouse: str | None = None
    """--fault-tolerant: the address (host:port) of a running torchft Lighthouse
    (torchft_lighthouse) for replicas on several machines; without it meshpipe starts one."""
    replica_id: int | None = None
    """--fault-tolerant --lighthouse: launch only this replica (0 to dp - 1) on this machine."""

    def __post_init__(self) -> None:
        require(
            self.fault_tolerant or (self.lighthouse is None and self.replica_id is None),
            "--lighthouse and --replica-id apply to --fault-tolerant runs: add "
            "--fault-tolerant or drop them",
        )
        require(
            self.replica_id is None or self.lighthouse is not None,
            f"--replica-id {self.replica_id} runs one replica of a job spread over machines, "
            "which needs their shared Lighthouse: add --lighthouse HOST:PORT (start one with "
            "torchft_lighthouse --min_replicas 1), or drop --replica-id to run every replica here",
        )
        require(
            self.lighthouse is None or bool(self.lighthouse.strip()),
            "--lighthouse is empty: give HOST:PORT of a running torchft_lighthouse",
        )


def check_fault_tolerance(ft: FaultTolerance, *, dp: int, tp: int, zero: int, dp_sync: str) -> None:
    """What `--fault-tolerant` cannot honour, refused by name with the way out."""
    if not ft.fault_tolerant:
        return
    require(
        dp > 1,
        "--fault-tolerant keeps training when a data-parallel replica dies, and --dp is 1: "
        "use --dp 2 or more, or drop --fault-tolerant",
    )
    require(
        ft.replica_id is None or 0 <= ft.replica_id < dp,
        f"--replica-id {ft.replica_id} is out of range for --dp {dp}: use 0 to {dp - 1}",
    )
    require(
        zero == 0,
        f"--fault-tolerant with --zero {zero}: ZeRO shards each stage's state over the dp "
        "replicas, so a dead replica takes shards nobody else holds, and torchft's quorum "
        "changes the replica count from step to step; use --zero 0 with --fault-tolerant",
    )
    require(
        tp == 1,
        f"--fault-tolerant with --tp {tp}: a healing replica would receive tensor-parallel "
        "(DTensor) state through torchft's checkpoint transport, which meshpipe has not "
        "checked; use --tp 1 with --fault-tolerant",
    )
    require(
        dp_sync == "every-step",
        f"--fault-tolerant with --dp-sync {dp_sync}: only every-step gradient sums go through "
        "torchft's quorum here; use --dp-sync every-step, or drop --fault-tolerant",
    )
