"""A run's own action costs, read back from its `meshpipe train --trace` file.

Fed to the simulator (`search.step_with_costs`), they tell its structure (the schedule's
order, the waits, the tails) apart from the prices the planner gave the actions: the planner's
prices come from a profile taken before the run, and on a shared CPU the run's actions may take
10-30 % more or less than that profile said (docs/BENCHMARKS.md).
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from engine.plan.timing import StageTimes
from engine.schedule.actions import parse_action

__all__ = ["run_costs"]

_COMPUTE = ("F", "B", "I", "W")
_AFTER = ("optimizer", "dp all-reduce")
"""What a rank runs after its last backward, timed on its own (the tied weights' sum is
left out: its time is mostly the wait for the other end, which the simulator adds itself)."""


def run_costs(
    trace: str | Path, placement: Sequence[int]
) -> tuple[tuple[StageTimes, ...], tuple[float, ...]]:
    """(each stage's action costs, each pipeline rank's seconds after its last backward): the
    means over the run's steps after its first (its warm-up), the work after the last
    backward the slowest replica's. `placement[s]`: the pipeline rank of stage s.

    Means, not medians: a step pays every action, its slow ones too. On this VM an action's
    times skew high, and the medians put the simulated step 2-6 % under the measured one
    where the means put it within 2 % (docs/BENCHMARKS.md, session 54)."""
    events = json.loads(Path(trace).read_text())["traceEvents"]
    names = {e["tid"]: e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    spans = [e for e in events if e.get("ph") == "X"]
    warm = _first_step_ends(spans, names)
    compute: dict[tuple[int, str], list[float]] = defaultdict(list)
    after: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    ranks: dict[str, int] = {}
    for e in spans:
        rank = names[e["tid"]].removesuffix(" communication")
        if e["ts"] < warm[rank]:
            continue
        if e.get("cat") in _COMPUTE:
            stage = parse_action(e["name"]).stage
            compute[stage, e["cat"]].append(e["dur"] / 1e6)
            ranks[rank] = placement[stage]
        elif e.get("cat") in _AFTER:
            after[rank][e["cat"]].append(e["dur"] / 1e6)
    stages = tuple(_stage(compute, s) for s in range(len(placement)))
    tails = [0.0] * (max(placement) + 1)
    for rank, phases in after.items():
        seconds = sum(statistics.fmean(durations) for durations in phases.values())
        tails[ranks[rank]] = max(tails[ranks[rank]], seconds)
    return stages, tuple(tails)


def _first_step_ends(spans: list[dict[str, Any]], names: dict[int, str]) -> dict[str, float]:
    """When each rank's first optimizer step ended (its warm-up step)."""
    ends: dict[str, float] = {}
    for e in spans:
        if e.get("cat") == "optimizer":
            rank = names[e["tid"]]
            ends[rank] = min(ends.get(rank, float("inf")), e["ts"] + e["dur"])
    return ends


def _stage(compute: dict[tuple[int, str], list[float]], stage: int) -> StageTimes:
    """The stage's mean F, B, I, W; a fused B where it ran none split, and the reverse."""
    mean = {k: statistics.fmean(compute[stage, k]) for k in _COMPUTE if compute[stage, k]}
    backward = mean.get("B", mean.get("I", 0.0) + mean.get("W", 0.0))
    return StageTimes(
        forward=mean.get("F", 0.0),
        backward=backward,
        input_grad=mean.get("I", backward),
        weight_grad=mean.get("W", 0.0),
        tp_comm=0.0,
        recompute=0.0,
    )
