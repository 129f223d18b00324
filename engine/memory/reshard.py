"""ZeRO-3's `--zero-reshard auto`: when each stage's gathered layers go back, chosen by the
memory model before any rank starts.

Keeping every layer gathered across the step's micro-batches (`step`) costs the least
communication (one gather and one reduce-scatter per layer and step) and the most memory (the
stage's weights in the compute dtype and its whole fp32 gradients, all step long). Resharding
per micro-batch costs a gather per forward and backward and a reduce-scatter per micro-batch,
and holds a layer or two at a time. A pipeline rank's memory is its own stages' alone, so
`auto` decides rank by rank: the stages of a rank whose predicted peak gathered for the step
does not fit the device reshard per micro-batch where that lowers the rank's peak (a small
stage's extra turn buffers can outweigh its gradient shards), and every other rank keeps the
least communication. A schedule with a split backward (zb_*) cannot reshard per micro-batch,
so it stays `step`. A run whose partition is chosen by memory gets one mode on every stage
(`--partition memory` splits for one mode), `micro-batch` where no split fits gathered for the
step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, TypeVar

from engine.config import PartitionConfig, format_size, replace_flat
from engine.memory.estimate import MemoryConfig, MemoryReport, estimate_memory
from engine.schedule.actions import split_units

__all__ = [
    "ReshardChoice",
    "choose_reshard",
    "choose_reshard_without_budget",
    "stages_text",
    "with_reshard",
]


@dataclass(frozen=True, kw_only=True)
class ReshardChoice:
    """The reshard mode a run uses, on which stages, and why."""

    reshard: str
    """`step` or `micro-batch` (`EngineOptions.zero_reshard`)."""
    stages: tuple[int, ...] | None = None
    """With `micro-batch`: the stages resharded per micro-batch, None for all
    (`EngineOptions.zero_reshard_stages`)."""
    reason: str
    """One line for the user: what was predicted against what budget."""

    @property
    def line(self) -> str:
        where = "" if self.stages is None else f" on {stages_text(self.stages)}"
        return f"--zero-reshard auto: {self.reshard}{where} ({self.reason})"


def choose_reshard(config: MemoryConfig, budget: int | None) -> ReshardChoice | None:
    """The modes `auto` stands for in `config` on devices of `budget` bytes; None where
    nothing is chosen (not ZeRO-3, or a mode given by hand)."""
    engine = config.engine
    if engine.zero != 3 or engine.zero_reshard != "auto":
        return None
    if budget is None:
        return choose_reshard_without_budget()
    kept = _report(config, "step")
    over = "gathered for the step " + (
        f"the peak is {_sizes(kept.peak, budget)}"
        if kept is not None
        else f"--partition memory finds no split within {format_size(budget)}"
    )
    if kept is not None and kept.peak <= budget:
        return ReshardChoice(reshard="step", reason=over.replace(" is ", " fits: ", 1))
    schedule = config.schedule.resolve(config.parallel.pp)
    if any(split_units(row) for row in schedule.rows):
        return ReshardChoice(
            reshard="step",
            reason=f"{over}, but schedule {schedule.name}'s split backward cannot reshard per "
            "micro-batch",
        )
    # where neither mode splits within the budget, the estimate's error says why
    resharded = _report(config, "micro-batch") or estimate_memory(
        with_reshard(config, "micro-batch")
    )
    return _reshard_ranks(
        kept,
        resharded,
        budget,
        over=over,
        stages_of=schedule.stages_of,
        whole=config.partition.by_memory,
    )


def _report(config: MemoryConfig, reshard: str) -> MemoryReport | None:
    """The estimate with every stage in `reshard`; None where --partition memory finds no
    split within the budget in that mode."""
    try:
        return estimate_memory(with_reshard(config, reshard))
    except ValueError as error:
        if not config.partition.by_memory or "no split fits" not in str(error):
            raise
        return None


def _reshard_ranks(
    kept: MemoryReport | None,
    resharded: MemoryReport,
    budget: int,
    *,
    over: str,
    stages_of: Callable[[int], tuple[int, ...]],
    whole: bool,
) -> ReshardChoice:
    """Per micro-batch on the stages of every rank over `budget` that resharding lowers;
    every stage or none where the partition is chosen for one mode on every stage (`whole`:
    `--partition memory`), or where gathered for the step no split fits (`kept` None)."""
    ranks = tuple(range(len(resharded.rank_peaks)))
    if kept is None or whole:
        chosen = ranks if kept is None or resharded.peak < kept.peak else ()
    else:
        chosen = tuple(r for r in ranks if budget < kept.rank_peaks[r] > resharded.rank_peaks[r])
    if not chosen:
        return ReshardChoice(
            reshard="step",
            reason=f"{over}, and resharded per micro-batch it would be "
            f"{format_size(resharded.peak)}, no less",
        )
    stages = None if chosen == ranks else tuple(sorted(s for r in chosen for s in stages_of(r)))
    peak = max((resharded if r in chosen or kept is None else kept).rank_peaks[r] for r in ranks)
    return ReshardChoice(
        reshard="micro-batch",
        stages=stages,
        reason=f"{over}; resharded per micro-batch{_where(chosen, stages)} it is "
        f"{format_size(peak)}",
    )


def stages_text(stages: tuple[int, ...]) -> str:
    """`stage 1` or `stages 0,2`, as a report names them."""
    return f"stage{'s' if len(stages) > 1 else ''} {','.join(map(str, stages))}"


def _where(ranks: tuple[int, ...], stages: tuple[int, ...] | None) -> str:
    if stages is None:
        return ""
    names = ",".join(map(str, ranks))
    return f" on rank{'s' if len(ranks) > 1 else ''} {names}'s stages"


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


class _Partitioned(Protocol):
    @property
    def partition(self) -> PartitionConfig: ...


Config = TypeVar("Config", bound=_Partitioned)
"""A composite config with a partition section: an estimate's or a training run's."""


def with_reshard(config: Config, reshard: str, stages: tuple[int, ...] | None = None) -> Config:
    """`config` (an estimate's or a run's) with ZeRO-3's reshard mode set on `stages` (all by
    default), and its budget kept only where `--partition memory` still reads it."""
    kept = config.partition.device_memory if config.partition.by_memory else None
    changed: Config = replace_flat(
        config, zero_reshard=reshard, zero_reshard_stages=stages, device_memory=kept
    )
    return changed
