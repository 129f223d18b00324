"""What the planner is asked and what it answers: the request (model, devices, memory,
batch, machine), a prediction per layout, the result, and a layout's settings by flat name."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.config import PRECISIONS, require
from engine.memory.estimate import DEVICE_MODELS
from engine.plan.candidates import Candidate
from engine.plan.hardware import Hardware
from engine.schedule import SCHEDULES, SimResult
from models import get_config

__all__ = [
    "LOSSES",
    "PlanRequest",
    "PlanResult",
    "Prediction",
    "Progress",
    "layout_fields",
    "reporting",
]

LOSSES = ("over memory", "more bubble", "more communication", "more recompute")
"""Why a candidate lost to the best plan."""

Progress = Callable[[str, int, int], None]
"""How a search reports as it goes: what it is doing ("tracing layers", "timing layouts",
"tracing stages"), how many are done, of how many."""


def reporting(progress: Progress | None, what: str) -> Callable[[int, int], None] | None:
    """`progress` for one kind of work: called with (done, total)."""
    return None if progress is None else functools.partial(progress, what)


@dataclass(frozen=True, kw_only=True)
class PlanRequest:
    """What to plan for: a model, devices and their memory, the batch, and the machine."""

    model: str
    devices: int
    device_memory: int
    """Bytes per device."""
    global_batch: int
    seq_len: int
    precision: str = "bf16"
    device: str = "cuda"
    """The memory model's device: cuda (allocator blocks) or cpu (exact bytes)."""
    hardware: Hardware = field(default_factory=Hardware)
    measured: Mapping[int, tuple[float, ...]] | None = None
    """Per micro-batch size, each layer's measured forward seconds (`--profile`); FLOPs at
    the hardware's rate when None."""
    measured_split: Mapping[tuple[int, int], tuple[float, ...]] | None = None
    """Per (micro-batch size, tp > 1), each layer's forward seconds measured split tp ways
    (`measured_split_forward`); `measured` over tp where a pair is missing."""
    measured_input_shares: Mapping[int, tuple[float, ...]] | None = None
    """Per micro-batch size, of each layer's backward the share the split backward runs at I,
    measured (`measured_input_shares`); by FLOPs where a size is missing."""
    micro_batch_sizes: tuple[int, ...] = (1, 2, 4, 8)
    schedules: tuple[str, ...] = tuple(SCHEDULES)
    top: int = 3

    def __post_init__(self) -> None:
        for name in ("devices", "global_batch", "seq_len", "device_memory", "top"):
            value = getattr(self, name)
            flag = "--" + name.replace("_", "-")
            require(value >= 1, f"{flag} {value}: give at least 1")
        context = get_config(self.model).max_seq_len
        require(
            self.seq_len <= context,
            f"--seq-len {self.seq_len} is longer than {self.model}'s context of {context} "
            f"tokens: use --seq-len {context} or less",
        )
        require(self.precision in PRECISIONS, f"precision {self.precision!r}: use {PRECISIONS}")
        require(self.device in DEVICE_MODELS, f"device {self.device!r}: use {DEVICE_MODELS}")
        unknown = sorted(set(self.schedules) - set(SCHEDULES))
        require(not unknown, f"unknown schedules {unknown}: choose among {', '.join(SCHEDULES)}")
        missing = [b for b in self.micro_batch_sizes if self.measured and b not in self.measured]
        require(not missing, f"micro-batch sizes {missing} have no measured layer times")


@dataclass(frozen=True, kw_only=True)
class Prediction:
    """A planned layout and what the memory model and the simulator predict for it."""

    candidate: Candidate
    boundaries: tuple[int, ...]
    step_time: float
    """Seconds per optimizer step."""
    bubble: float
    tokens_per_s: float
    mfu: float
    """Model FLOPs (3 × forward, recompute not counted) over the devices' peak."""
    communication: float
    """Seconds of the step the busiest rank spends in collectives and transfers."""
    recompute: float
    stage_peaks: tuple[int, ...]
    rank_peaks: tuple[int, ...]
    simulated: SimResult | None = None
    tails: tuple[float, ...] = ()
    """With `simulated`: each pipeline rank's seconds after its last backward (its
    data-parallel reduction and optimizer update), which the step ends with."""


@dataclass(frozen=True, kw_only=True)
class PlanResult:
    request: PlanRequest
    plans: tuple[Prediction, ...]
    """The best few, fastest first."""
    considered: int
    losses: dict[str, int]
    least_memory: int | None
    """The lowest per-device peak of any candidate (every stage recomputed)."""


def layout_fields(request: PlanRequest, c: Candidate, boundaries: Sequence[int]) -> dict[str, Any]:
    """A layout's settings by flat name (`engine.config`), every one of them."""
    every = len(c.recompute) == c.num_stages
    return {
        "model": request.model,
        "pp": c.mesh.pp,
        "dp": c.mesh.dp,
        "tp": c.mesh.tp,
        "schedule": c.schedule,
        "stages_per_rank": c.stages_per_rank,
        "micro_batches": c.micro_batches,
        "global_batch": request.global_batch,
        "seq_len": request.seq_len,
        "precision": request.precision,
        "partition": "boundaries:" + ",".join(map(str, boundaries)),
        "zero": c.zero,
        "zero_reshard": c.zero_reshard,
        "optimizer_impl": "per_tensor" if c.zero == 3 else "fused",
        "recompute": c.recompute_policy,
        "recompute_stages": None if every or not c.recompute else ",".join(map(str, c.recompute)),
    }
