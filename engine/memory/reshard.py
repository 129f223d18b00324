"""ZeRO-3's `--zero-reshard auto`: when a stage's gathered layers go back, chosen by the memory
model before any rank starts.

Keeping every layer gathered across the step's micro-batches (`step`) costs the least
communication (one gather and one reduce-scatter per layer and step) and the most memory (the
stage's weights in the compute dtype and its whole fp32 gradients, all step long). Resharding
per micro-batch costs a gather per forward and backward and a reduce-scatter per micro-batch,
and holds a layer or two at a time. So `auto` keeps `step` while the predicted peak of every
rank fits the device (or no budget is given), and reshards per micro-batch only when it does
not and resharding lowers the peak (a small stage's extra turn buffers can outweigh its
gradient shards); a schedule with a split backward (zb_*) cannot reshard per micro-batch, so
it stays `step`.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.config import format_size, replace_flat
from engine.memory.estimate import MemoryConfig, estimate_memory, resolve
from engine.schedule.actions import split_units

__all__ = ["ReshardChoice", "choose_reshard", "choose_reshard_without_budget", "with_reshard"]


@dataclass(frozen=True, kw_only=True)
class ReshardChoice:
    """The reshard mode a run uses, and why."""

    reshard: str
    """`step` or `micro-batch` (`EngineOptions.zero_reshard`)."""
    reason: str
    """One line for the user: what was predicted against what budget."""

    @property
    def line(self) -> str:
        return f"--zero-reshard auto: {self.reshard} ({self.reason})"


def choose_reshard(config: MemoryConfig, budget: int | None) -> ReshardChoice | None:
    """The mode `auto` stands for in `config` on devices of `budget` bytes; None where
    nothing is chosen (not ZeRO-3, or a mode given by hand)."""
    engine = config.engine
    if engine.zero != 3 or engine.zero_reshard != "auto":
        return None
    if budget is None:
        return choose_reshard_without_budget()
    kept = estimate_memory(with_reshard(config, "step")).peak
    over = f"gathered for the step the peak is {_sizes(kept, budget)}"
    if kept <= budget:
        return ReshardChoice(reshard="step", reason=over.replace(" is ", " fits: ", 1))
    schedule = resolve(config).schedule
    if any(split_units(row) for row in schedule.rows):
        return ReshardChoice(
            reshard="step",
            reason=f"{over}, but schedule {schedule.name}'s split backward cannot reshard per "
            "micro-batch",
        )
    per_micro_batch = estimate_memory(with_reshard(config, "micro-batch")).peak
    if per_micro_batch >= kept:
        return ReshardChoice(
            reshard="step",
            reason=f"{over}, and resharded per micro-batch it would be "
            f"{format_size(per_micro_batch)}, no less",
        )
    return ReshardChoice(
        reshard="micro-batch",
        reason=f"{over}; resharded per micro-batch it is {format_size(per_micro_batch)}",
    )


def _sizes(peak: int, budget: int) -> str:
    """`peak` against `budget`, in bytes where the rounded sizes would read the same."""
    a, b = format_size(peak), format_size(budget)
    if a == b:
        a, b = f"{peak:,} bytes", f"{budget:,} bytes"
    relation = "within" if peak <= budget else "over"
    return f"{a}, {relation} {b}"


def choose_reshard_without_budget() -> ReshardChoice:
    """With no budget, the least communication."""
    return ReshardChoice(
        reshard="step",
        reason="no --device-memory given: layers stay gathered for the step, the least "
        "communication",
    )


def with_reshard(config: MemoryConfig, reshard: str) -> MemoryConfig:
    """`config` with ZeRO-3's reshard mode set (and its budget kept only where `--partition
    memory` still reads it)."""
    kept = config.partition.device_memory if config.partition.by_memory else None
    changed: MemoryConfig = replace_flat(config, zero_reshard=reshard, device_memory=kept)
    return changed
