"""The fastest contiguous partition whose every stage fits its memory budget.

A pipeline's throughput is set by its slowest stage: in the steady state of every schedule
meshpipe runs, each stage handles one micro-batch per slowest-stage time, so a step of `m`
micro-batches takes at least `m · max_s t_s`. `fastest_fitting` minimises that bottleneck
exactly, subject to a memory test per stage that the caller supplies (the memory model knows
what a stage holds: its layers' states, and activations times the schedule's in-flight count at
that stage, which differs stage by stage). Among partitions with the same bottleneck the
caller may rank by the simulator (`engine.plan` does).

Why it is exact, and fast: both tests are monotone in a stage's extent (a stage's time and
memory only grow as it takes more layers), so for a given bottleneck B the ends a stage can
reach from one start form an interval, and a dynamic program over (stage, boundary) decides
whether any partition meets B in O(S·L) memory tests (a greedy that lets early stages take
all they can is not enough: budgets differ by stage, so a layer pushed late may not fit
there). Feasibility is monotone in B and the optimum is one of the O(L²) segment sums, so a
binary search over them finds it: milliseconds for 126 layers and 16 stages.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import accumulate

from partitioners._checks import check_costs, check_num_stages
from partitioners.partition import Partition

__all__ = ["StageFits", "fastest_fitting", "min_bottleneck"]

StageFits = Callable[[int, int, int], bool]
"""`fits(stage, first, stop)`: whether layers `[first, stop)` fit as stage `stage`. Must be
monotone: if a range fits, every range inside it fits as the same stage."""


def _fitting_bounds(
    prefix: Sequence[float], num_stages: int, limit: float, fits: StageFits
) -> tuple[int, ...] | None:
    """Boundaries of a partition whose stages all stay within `limit` and fit, or None.

    Stage by stage, the positions a stage can end at: from each reachable start `a`, every
    end up to the farthest one that stays within `limit` and fits. That farthest end never
    decreases as `a` grows (monotone tests), so one pointer sweeps each stage in O(L) tests.
    """
    num_layers = len(prefix) - 1
    parents: list[dict[int, int]] = []
    starts = [0]
    for stage in range(num_stages):
        last_allowed = num_layers - (num_stages - stage - 1)
        ends: dict[int, int] = {}
        end = covered = 0
        for first in starts:
            end = max(end, first)
            while end < last_allowed and (
                prefix[end + 1] - prefix[first] <= limit and fits(stage, first, end + 1)
            ):
                end += 1
            for stop in range(max(covered, first) + 1, end + 1):
                ends[stop] = first
            covered = max(covered, end)
        if not ends:
            return None
        parents.append(ends)
        starts = sorted(ends)
    if num_layers not in parents[-1]:
        return None
    bounds = [num_layers]
    for ends in reversed(parents):
        bounds.append(ends[bounds[-1]])
    return tuple(reversed(bounds))


def _segment_sums(prefix: Sequence[float]) -> list[float]:
    n = len(prefix)
    return sorted({prefix[j] - prefix[i] for i in range(n) for j in range(i + 1, n)})


def min_bottleneck(
    times: Sequence[float], num_stages: int, fits: StageFits
) -> tuple[float, Partition] | None:
    """The smallest slowest-stage time any fitting partition reaches, and a partition
    that reaches it; None when no partition into `num_stages` stages fits."""
    values = check_costs(times, name="times")
    check_num_stages(len(values), num_stages)
    prefix = list(accumulate(values, initial=0))
    candidates = _segment_sums(prefix)
    if _fitting_bounds(prefix, num_stages, candidates[-1], fits) is None:
        return None
    low, high = 0, len(candidates) - 1
    while low < high:
        middle = (low + high) // 2
        if _fitting_bounds(prefix, num_stages, candidates[middle], fits) is None:
            low = middle + 1
        else:
            high = middle
    limit = candidates[low]
    bounds = _fitting_bounds(prefix, num_stages, limit, fits)
    assert bounds is not None
    return limit, Partition(boundaries=bounds)


def fastest_fitting(
    times: Sequence[float],
    num_stages: int,
    fits: StageFits,
    *,
    what_fails: Callable[[], str] = lambda: "",
) -> Partition:
    """The partition with the smallest slowest stage among those where every stage fits.

    Raises ValueError when none fits, with `what_fails()` (the caller's account of the
    memory it would need) appended.
    """
    found = min_bottleneck(times, num_stages, fits)
    if found is None:
        detail = what_fails()
        raise ValueError(
            f"no split of {len(times)} layers into {num_stages} stages fits every stage's "
            f"memory budget{': ' + detail if detail else ''}"
        )
    return found[1]
