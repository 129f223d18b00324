"""How a step is pipelined (the schedule, its micro-batches and stages per rank) and how the
model is cut into stages (the partition method and the costs it balances)."""

from __future__ import annotations

from dataclasses import dataclass

from engine.config.fields import require
from engine.config.sizes import parse_size
from engine.schedule import PLACEMENTS, Schedule, schedule_for
from partitioners import COST_MODELS

__all__ = ["PartitionConfig", "ScheduleConfig"]


@dataclass(frozen=True, kw_only=True)
class ScheduleConfig:
    """The pipeline schedule a step runs."""

    schedule: str = "1f1b"
    """Pipeline schedule: gpipe, 1f1b, interleaved_1f1b, looped_bfs, zb_h1, zb_h2, zb_drain,
    or over the V placement zb_v, dualpipe_v, v_half, v_min (2 stages per rank), or a schedule
    file (meshpipe schedule --out FILE, or rows of actions written by hand)."""
    micro_batches: int = 4
    """Micro-batches each replica's batch is split into (gradient accumulation)."""
    stages_per_rank: int = 1
    """Stages per pipeline rank (v > 1 with interleaved_1f1b or looped_bfs, 2 with the V
    schedules)."""
    placement: str | None = None
    """Where the stages of several per rank live: loop (stage s on rank s mod pp) or v (rank r
    holds stages r and 2pp-1-r, the first and last on rank 0); unset: the schedule's own."""

    def __post_init__(self) -> None:
        for name in ("micro_batches", "stages_per_rank"):
            value = getattr(self, name)
            require(value >= 1, f"{name}={value} must be at least 1")
        require(
            self.placement in (None, *PLACEMENTS),
            f"placement={self.placement!r}: choose one of {', '.join(PLACEMENTS)} (or leave it "
            "unset for the schedule's own)",
        )

    def resolve(self, pp: int) -> Schedule:
        """The compute schedule on `pp` pipeline ranks (a file is checked and dry-run)."""
        return schedule_for(
            self.schedule,
            num_ranks=pp,
            micro_batches=self.micro_batches,
            stages_per_rank=self.stages_per_rank,
            placement=self.placement,
        )


@dataclass(frozen=True, kw_only=True)
class PartitionConfig:
    """How the layer list is cut into stages (the method is checked when the layout is
    partitioned, by `partitioners.make_partition`)."""

    partition: str = "balanced"
    """Partition method: uniform, parameters, balanced, memory, type:<regex>, boundaries:…,
    balance:… (`memory`: the fastest split whose every stage fits --device-memory)."""
    cost_model: str = "flops"
    """Costs `balanced` balances: flops, parameters, activations or time (measured)."""
    device_memory: str | None = None
    """Memory of each device, e.g. 80GB or 80GiB: the budget of --partition memory and of
    ZeRO-3's --zero-reshard auto (`check_budget`)."""

    def __post_init__(self) -> None:
        memory = self.by_memory
        require(
            not memory or self.device_memory is not None,
            "--partition memory fits every stage into the device's memory: give --device-memory "
            "(e.g. 80GB)",
        )
        if self.device_memory is not None:
            parse_size(self.device_memory)
        require(
            self.cost_model in COST_MODELS,
            f"unknown cost model {self.cost_model!r}: choose one of "
            f"{', '.join(m for m in COST_MODELS if m != 'time')}, or time (measured by running "
            "the layers; an estimate that allocates nothing cannot)",
        )

    @property
    def by_memory(self) -> bool:
        """Whether the split is `fastest_fitting`'s, which the memory model resolves."""
        return self.partition.strip().lower() == "memory"

    @property
    def budget(self) -> int | None:
        """`device_memory` in bytes."""
        return None if self.device_memory is None else parse_size(self.device_memory)
