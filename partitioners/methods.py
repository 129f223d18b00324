"""Partitioning methods: per-layer costs in, a ``Partition`` out.

Pure functions with no torch imports, so they run in the planner, the CLI and unit tests alike.
The method strings follow DeepSpeed's ``partition_method`` (``uniform``, ``parameters``,
``type:<regex>``) plus an exact min-max ``balanced`` and explicit layouts.
"""

from __future__ import annotations

import re
from bisect import bisect_left, bisect_right
from collections.abc import Sequence
from itertools import accumulate, pairwise
from typing import TypeVar

from partitioners._checks import check_costs, check_int_tuple, check_num_stages
from partitioners.partition import Partition

__all__ = [
    "PARTITION_METHODS",
    "balanced",
    "by_parameters",
    "by_type",
    "explicit",
    "make_partition",
    "uniform",
]

PARTITION_METHODS: tuple[str, ...] = (
    "uniform",
    "parameters",
    "balanced",
    "type",
    "boundaries",
    "balance",
)
"""Method names accepted by ``make_partition``; the last three take an argument after ``:``."""

_T = TypeVar("_T")

_METHOD_FORMS = (
    "'uniform'",
    "'parameters'",
    "'balanced'",
    "'memory' (with --device-memory)",
    "'type:<regex>'",
    "'boundaries:0,b1,...,L'",
    "'balance:n0,n1,...'",
)


def uniform(num_layers: int, num_stages: int) -> Partition:
    """Equal layer counts; when they do not divide, the first ``L % S`` stages get one extra.

    Same rule as ``torch.tensor_split`` and DeepSpeed's ``partition_uniform``: L=10, S=4 gives
    sizes 3, 3, 2, 2.
    """
    check_num_stages(num_layers, num_stages)
    base, extra = divmod(num_layers, num_stages)
    return Partition.from_balance([base + (1 if s < extra else 0) for s in range(num_stages)])


def balanced(costs: Sequence[float], num_stages: int) -> Partition:
    """Contiguous split that exactly minimises the largest stage cost.

    Ties: among all optimal partitions, every boundary is as small as possible (the result is
    the componentwise, hence lexicographic, minimum), so earlier stages get fewer layers; they
    hold the most in-flight activations under 1F1B.

    Exact for floats: costs are scaled to integers without rounding (floats are dyadic), the
    optimal bottleneck is found by binary search over those integers with a greedy feasibility
    check, in O(bits * S * log L).
    """
    values = check_costs(costs)
    check_num_stages(len(values), num_stages)
    return _balanced(values, num_stages)


def by_parameters(param_counts: Sequence[int], num_stages: int) -> Partition:
    """``balanced`` on parameter counts (DeepSpeed's ``parameters`` method, but exact)."""
    values = check_costs(param_counts, name="param_counts")
    check_num_stages(len(values), num_stages)
    return _balanced(values, num_stages)


def by_type(kinds: Sequence[str], pattern: str, num_stages: int) -> Partition:
    """DeepSpeed's ``type:<regex>``: spread the layers whose class name matches evenly.

    A layer matches if ``re.search(pattern, kind, re.IGNORECASE)`` does. Stage ``s`` gets the
    count ``uniform(matched, S)`` gives stage ``s`` (``ceil`` for the first ``matched % S``
    stages, ``floor`` for the rest), so no stage is left without a match. Balancing 0/1 weights
    min-max would only bound the largest stage and could leave an early stage with none.

    Each stage after the first starts at its first matching layer: non-matching layers join
    the match before them (a norm stays with the block it follows), and leading ones (the
    embedding) join stage 0. With the counts fixed every stage weighs exactly its count, so
    there is no other balance to choose by and the layout is unique.

    A leading ``type:`` is stripped (class names never contain ``:``), so the DeepSpeed method
    string can be passed as is.
    """
    regex_text = pattern.removeprefix("type:")
    try:
        regex = re.compile(regex_text, re.IGNORECASE)
    except re.error as err:
        raise ValueError(f"type regex {regex_text!r} does not compile ({err}): fix it") from None
    check_num_stages(len(kinds), num_stages)
    positions = [index for index, kind in enumerate(kinds) if regex.search(kind)]
    matched = len(positions)
    if matched < num_stages:
        seen = ", ".join(dict.fromkeys(kinds))
        raise ValueError(
            f"type:{regex_text} matched {matched} of {len(kinds)} layers but {num_stages} "
            f"stages need at least one each: use at most {max(matched, 1)} stages or a regex "
            f"matching more kinds (kinds seen: {seen})"
        )
    firsts = uniform(matched, num_stages).boundaries[1:-1]
    return Partition(boundaries=(0, *(positions[first] for first in firsts), len(kinds)))


def explicit(boundaries_or_balance: Sequence[int], num_layers: int) -> Partition:
    """A layout given by hand: boundaries ``(0, ..., L)`` or a balance ``[n0, n1, ...]``.

    A leading 0 means boundaries, anything else a balance: a balance entry of 0 would be an
    empty stage, so the two forms never overlap.
    """
    values = check_int_tuple(boundaries_or_balance, "explicit partition")
    if not values:
        raise ValueError(
            "explicit partition is empty: give boundaries (0, ..., L) or a balance [n0, n1, ...]"
        )
    if values[0] == 0:
        return _from_boundaries(values, num_layers)
    return _from_balance(values, num_layers)


def make_partition(
    method: str,
    *,
    num_stages: int,
    num_layers: int,
    costs: Sequence[float] | None = None,
    params: Sequence[int] | None = None,
    kinds: Sequence[str] | None = None,
) -> Partition:
    """Dispatch a config's method string to the partitioner it names.

    Forms: ``uniform``, ``parameters`` (needs ``params``), ``balanced`` (needs ``costs``),
    ``type:<regex>`` (needs ``kinds``), ``boundaries:0,3,6,8``, ``balance:3,3,2``.
    Method names are case-insensitive; the regex keeps its text.
    """
    check_num_stages(num_layers, num_stages)
    name, colon, arg = method.strip().partition(":")
    key = name.strip().lower()
    if not colon and key == "uniform":
        return uniform(num_layers, num_stages)
    if not colon and key == "parameters":
        return by_parameters(_needs(params, "params", method, num_layers), num_stages)
    if not colon and key == "balanced":
        return balanced(_needs(costs, "costs", method, num_layers), num_stages)
    if colon and key == "type":
        return by_type(_needs(kinds, "kinds", method, num_layers), arg, num_stages)
    if colon and key in ("boundaries", "balance"):
        values = _parse_ints(arg, method)
        part = (_from_boundaries if key == "boundaries" else _from_balance)(values, num_layers)
        if part.num_stages != num_stages:
            raise ValueError(
                f"partition method {method!r} describes {part.num_stages} stages but "
                f"num_stages = {num_stages}: make them agree"
            )
        return part
    raise ValueError(f"unknown partition method {method!r}: use one of {', '.join(_METHOD_FORMS)}")


def _needs(value: Sequence[_T] | None, name: str, method: str, num_layers: int) -> Sequence[_T]:
    if value is None:
        raise ValueError(
            f"partition method {method!r} needs {name}: pass {name}= with one entry per layer"
        )
    if len(value) != num_layers:
        raise ValueError(
            f"{name} has {len(value)} entries but num_layers = {num_layers}: "
            "give one entry per layer"
        )
    return value


def _parse_ints(text: str, method: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise ValueError(
            f"cannot parse partition method {method!r}: expected comma-separated integers "
            "such as 'boundaries:0,3,6,8' or 'balance:3,3,2'"
        ) from None


def _from_boundaries(values: tuple[int, ...], num_layers: int) -> Partition:
    part = Partition(boundaries=values)
    if part.num_layers != num_layers:
        raise ValueError(
            f"boundaries {values} end at {part.num_layers} but the model has {num_layers} "
            f"layers: end them at {num_layers}"
        )
    return part


def _from_balance(values: tuple[int, ...], num_layers: int) -> Partition:
    part = Partition.from_balance(values)
    if part.num_layers != num_layers:
        raise ValueError(
            f"balance {list(values)} covers {part.num_layers} layers but the model has "
            f"{num_layers}: make the entries sum to {num_layers}"
        )
    return part


def _balanced(values: Sequence[float], num_stages: int) -> Partition:
    prefix = _exact_prefix_sums(values)
    limit = _min_bottleneck(prefix, num_stages)
    return Partition(boundaries=_smallest_boundaries(prefix, num_stages, limit))


def _exact_prefix_sums(values: Sequence[float]) -> list[int]:
    """Prefix sums of ``values * D`` as exact integers (``D`` a common power-of-two scale)."""
    ratios = [value.as_integer_ratio() for value in values]
    scale = max(den for _, den in ratios)  # every denominator is a power of two
    return list(accumulate((num * (scale // den) for num, den in ratios), initial=0))


def _min_bottleneck(prefix: Sequence[int], num_stages: int) -> int:
    """The smallest achievable largest-stage cost: binary search over integers."""
    low = max(b - a for a, b in pairwise(prefix))
    high = prefix[-1]
    while low < high:
        mid = (low + high) // 2
        if _fits(prefix, num_stages, mid):
            high = mid
        else:
            low = mid + 1
    return low


def _fits(prefix: Sequence[int], num_stages: int, limit: int) -> bool:
    """Whether at most ``num_stages`` stages of cost ``<= limit`` cover all layers.

    Greedy: each stage takes as many layers as fit. ``limit`` is at least the largest single
    cost, so each stage advances; fewer stages than ``num_stages`` can always be split further.
    """
    num_layers = len(prefix) - 1
    start = 0
    for _ in range(num_stages):
        start = bisect_right(prefix, prefix[start] + limit, lo=start) - 1
        if start == num_layers:
            return True
    return False


def _smallest_boundaries(prefix: Sequence[int], num_stages: int, limit: int) -> tuple[int, ...]:
    """Boundaries with stage costs ``<= limit``, each as small as any such partition allows.

    Greedy from the last stage: each stage reaches back as far as ``limit`` allows while
    leaving one layer for each earlier stage. By induction each boundary is ``<=`` the same
    boundary of any feasible partition, so the result is their componentwise minimum.
    """
    bounds = [len(prefix) - 1]
    for stage in range(num_stages - 1, 0, -1):
        end = bounds[-1]
        start = max(bisect_left(prefix, prefix[end] - limit, 0, end), stage)
        assert start < end, "limit is below a single layer's cost"
        bounds.append(start)
    assert prefix[bounds[-1]] <= limit, "limit is not feasible"
    bounds.append(0)
    return tuple(reversed(bounds))
