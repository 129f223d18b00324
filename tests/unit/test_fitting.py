"""`fastest_fitting`: the smallest slowest stage among partitions where every stage fits."""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence

import pytest

from partitioners import Partition, fastest_fitting, min_bottleneck


def _all_partitions(num_layers: int, num_stages: int) -> list[tuple[int, ...]]:
    return [
        (0, *cuts, num_layers)
        for cuts in itertools.combinations(range(1, num_layers), num_stages - 1)
    ]


def _brute_force(
    times: Sequence[int], num_stages: int, budgets: Sequence[int], memory: Sequence[int]
) -> int | None:
    best = None
    for bounds in _all_partitions(len(times), num_stages):
        stages = list(itertools.pairwise(bounds))
        if all(
            sum(memory[a:b]) * (num_stages - s) <= budgets[s] for s, (a, b) in enumerate(stages)
        ):
            slowest = max(sum(times[a:b]) for a, b in stages)
            best = slowest if best is None else min(best, slowest)
    return best


def _fits(budgets: Sequence[int], memory: Sequence[int], num_stages: int):  # type: ignore[no-untyped-def]
    """1F1B-like: stage s keeps num_stages - s micro-batches of its layers' activations."""
    return lambda s, a, b: sum(memory[a:b]) * (num_stages - s) <= budgets[s]


def test_without_memory_limits_it_is_the_min_max_split() -> None:
    found = min_bottleneck([4, 1, 1, 1, 1, 4], 3, lambda s, a, b: True)
    assert found == (4, Partition(boundaries=(0, 1, 5, 6)))


def test_a_tight_first_stage_pushes_layers_to_later_stages() -> None:
    memory = [1] * 6
    fits = _fits([3, 100, 100], memory, 3)  # stage 0 keeps 3 micro-batches: one layer fits
    partition = fastest_fitting([1] * 6, 3, fits)
    assert partition.layers_of(0) == range(1)
    assert max(len(partition.layers_of(s)) for s in range(3)) == 3


@pytest.mark.parametrize("seed", range(300))
def test_equals_brute_force_on_small_cases(seed: int) -> None:
    rng = random.Random(seed)
    num_layers, num_stages = rng.randint(2, 9), rng.randint(1, 4)
    num_stages = min(num_stages, num_layers)
    times = [rng.randint(0, 9) for _ in range(num_layers)]
    memory = [rng.randint(1, 5) for _ in range(num_layers)]
    budgets = [rng.randint(3, 30) for _ in range(num_stages)]
    expected = _brute_force(times, num_stages, budgets, memory)
    found = min_bottleneck(times, num_stages, _fits(budgets, memory, num_stages))
    if expected is None:
        assert found is None
        return
    assert found is not None
    slowest, partition = found
    assert slowest == expected
    stops = partition.boundaries
    assert max(sum(times[a:b]) for a, b in itertools.pairwise(stops)) == expected
    assert all(
        _fits(budgets, memory, num_stages)(s, r.start, r.stop)
        for s, r in enumerate(partition.layers_of(s) for s in range(num_stages))
    )


def test_nothing_fits_names_the_stage_count_and_the_callers_detail() -> None:
    with pytest.raises(ValueError, match="no split of 4 layers into 2 stages fits.*need 9 GiB"):
        fastest_fitting([1] * 4, 2, lambda s, a, b: False, what_fails=lambda: "need 9 GiB")
