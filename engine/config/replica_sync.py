"""How the data-parallel replicas of each stage stay together: every step (gradients summed),
semi-synchronously (local SGD, DiLoCo), each replica training alone between meetings, or
through a parameter server per stage with bounded staleness."""

from __future__ import annotations

from dataclasses import dataclass

from engine.config.fields import require

__all__ = ["DP_SYNCS", "ReplicaSync", "check_replica_sync"]

DP_SYNCS = ("every-step", "local-sgd", "diloco", "parameter-server")
"""every-step: gradients all-reduced every step; local-sgd: parameters averaged every H steps;
diloco: outer gradients averaged every H steps and applied by an outer Nesterov SGD;
parameter-server: gradients pushed to and parameters pulled from a server per stage."""

_DILOCO_DEFAULTS = {"outer_lr": 0.7, "outer_momentum": 0.9}
"""The DiLoCo paper's outer optimizer (Douillard et al. 2023): SGD, lr 0.7, Nesterov 0.9."""


@dataclass(frozen=True, kw_only=True)
class ReplicaSync:
    """When and how the replicas of a stage exchange what they learnt. Between meetings a
    semi-synchronous replica never touches the dp group: its pipeline ranks wait only on each
    other, which pays off where the link between replicas is slow."""

    dp_sync: str = "every-step"
    """every-step (gradients all-reduced each step), local-sgd (each replica steps its own
    optimizer and the parameters are averaged every --sync-every steps) or diloco (every
    --sync-every steps the replicas average how far they moved and an outer Nesterov SGD
    applies it, --outer-lr, --outer-momentum) or parameter-server (a server per stage holds
    the master weights and the optimizer: replicas push gradients and pull weights, at most
    --max-staleness updates behind)."""
    sync_every: int = 1
    """local-sgd and diloco: steps each replica trains alone between two meetings (H)."""
    outer_lr: float = _DILOCO_DEFAULTS["outer_lr"]
    """diloco: the outer optimizer's learning rate (1 with no momentum is local SGD)."""
    outer_momentum: float = _DILOCO_DEFAULTS["outer_momentum"]
    """diloco: the outer optimizer's Nesterov momentum (0: plain outer SGD)."""
    max_staleness: int = 0
    """parameter-server: updates a replica may compute ahead of the server's (K): before its
    step t + 1 it holds at least the server's update of step t - K (0: synchronous)."""

    def __post_init__(self) -> None:
        require(
            self.dp_sync in DP_SYNCS,
            f"--dp-sync {self.dp_sync!r}: choose one of {', '.join(DP_SYNCS)}",
        )
        require(
            isinstance(self.sync_every, int) and self.sync_every >= 1,
            f"--sync-every {self.sync_every} must be at least 1 (the steps a replica trains "
            "alone between two meetings)",
        )
        require(
            self.periodic or self.sync_every == 1,
            f"--sync-every {self.sync_every} applies to --dp-sync local-sgd or diloco, but "
            f"--dp-sync is {self.dp_sync}: add --dp-sync local-sgd (or diloco), or drop "
            "--sync-every",
        )
        given = [k for k, v in _DILOCO_DEFAULTS.items() if getattr(self, k) != v]
        require(
            self.dp_sync == "diloco" or not given,
            f"{', '.join('--' + k.replace('_', '-') for k in given)} only apply to --dp-sync "
            f"diloco (this run is {self.dp_sync}): add --dp-sync diloco or drop them",
        )
        require(
            isinstance(self.max_staleness, int) and self.max_staleness >= 0,
            f"--max-staleness {self.max_staleness} must be 0 (synchronous) or more",
        )
        require(
            self.dp_sync == "parameter-server" or self.max_staleness == 0,
            f"--max-staleness {self.max_staleness} applies to --dp-sync parameter-server, but "
            f"--dp-sync is {self.dp_sync}: add --dp-sync parameter-server, or drop --max-staleness",
        )
        require(self.outer_lr > 0, f"--outer-lr {self.outer_lr} must be > 0")
        require(
            0 <= self.outer_momentum < 1,
            f"--outer-momentum {self.outer_momentum} must be in [0, 1) (0: no momentum)",
        )

    @property
    def periodic(self) -> bool:
        """Whether replicas meet every `sync_every` steps instead of every step."""
        return self.dp_sync in ("local-sgd", "diloco")

    @property
    def alone(self) -> bool:
        """Whether each replica steps on its own gradient (no every-step all-reduce over dp)."""
        return self.dp_sync != "every-step"


def check_replica_sync(
    sync: ReplicaSync, *, dp: int, zero: int, saves: bool, save_every: int, steps: int
) -> None:
    """What a semi-synchronous run cannot honour, refused by name with the way out."""
    if not sync.alone:
        return
    require(
        dp > 1,
        f"--dp-sync {sync.dp_sync} synchronises data-parallel replicas, and --dp is 1: use "
        "--dp 2 or more, or drop --dp-sync",
    )
    require(
        zero == 0,
        f"--dp-sync {sync.dp_sync} with --zero {zero}: ZeRO shards each stage's optimizer "
        "state (and more) over its replicas, which assumes they hold the same weights every "
        "step; semi-synchronous replicas each keep their own. Use --zero 0, or --dp-sync "
        "every-step",
    )
    require(
        sync.periodic or not saves,
        f"--dp-sync {sync.dp_sync} with --checkpoint-dir: the server's master weights and "
        "optimizer state are not saved (and with --max-staleness > 0 the replicas hold "
        "different weights at any step); train without --checkpoint-dir, or use --dp-sync "
        "every-step, local-sgd or diloco",
    )
    every = sync.sync_every
    require(
        not saves or (save_every % every == 0 and steps % every == 0),
        f"--dp-sync {sync.dp_sync} --sync-every {every} with --save-every {save_every} and "
        f"--steps {steps}: a checkpoint holds one copy of the weights, which the replicas "
        f"share only right after a meeting; give --save-every and --steps multiples of {every}",
    )
