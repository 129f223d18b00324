"""Partitioners as data: literal tables, brute-force optimality, and every input error."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from partitioners import (
    PARTITION_METHODS,
    Partition,
    balanced,
    by_parameters,
    by_type,
    explicit,
    make_partition,
    uniform,
)

KINDS = ["Embedding"] + ["Block"] * 8 + ["LayerNorm", "Head"]


def _all_partitions(num_layers: int, num_stages: int) -> list[Partition]:
    """Every contiguous split into non-empty stages."""
    return [
        Partition(boundaries=(0, *cuts, num_layers))
        for cuts in itertools.combinations(range(1, num_layers), num_stages - 1)
    ]


def _exact_max(part: Partition, costs: Sequence[float]) -> Fraction:
    """Largest stage cost in exact rational arithmetic, so ties are true ties."""
    exact = [Fraction(cost) for cost in costs]
    return max(sum(exact[a:b], Fraction(0)) for a, b in itertools.pairwise(part.boundaries))


# --- uniform ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("num_layers", "num_stages", "boundaries"),
    [
        (10, 4, (0, 3, 6, 8, 10)),
        (8, 4, (0, 2, 4, 6, 8)),
        (7, 3, (0, 3, 5, 7)),
        (5, 5, (0, 1, 2, 3, 4, 5)),
        (5, 1, (0, 5)),
        (11, 4, (0, 3, 6, 9, 11)),
    ],
)
def test_uniform_gives_extra_layers_to_earlier_stages(
    num_layers: int, num_stages: int, boundaries: tuple[int, ...]
) -> None:
    assert uniform(num_layers, num_stages).boundaries == boundaries


# --- balanced -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("costs", "num_stages", "boundaries", "stage_costs"),
    [
        ([1, 2, 3, 4, 5, 6, 7, 8, 9], 3, (0, 5, 7, 9), (15, 13, 17)),
        ([1, 1, 1, 1], 2, (0, 2, 4), (2, 2)),
        ([10, 1, 1, 1], 2, (0, 1, 4), (10, 3)),
        ([1, 1, 1, 10], 2, (0, 3, 4), (3, 10)),
        ([5], 1, (0, 1), (5,)),
        ([0.5, 0.25, 0.25, 1.0], 2, (0, 3, 4), (1.0, 1.0)),
        # Ties go to the smallest boundaries: zero-cost layers pile onto the last stage.
        ([0, 0, 0, 0, 0], 3, (0, 1, 2, 5), (0, 0, 0)),
        ([1, 0, 0, 1], 2, (0, 1, 4), (1, 1)),
    ],
)
def test_balanced_table(
    costs: list[float],
    num_stages: int,
    boundaries: tuple[int, ...],
    stage_costs: tuple[float, ...],
) -> None:
    part = balanced(costs, num_stages)
    assert part.boundaries == boundaries
    assert part.stage_costs(costs) == stage_costs


def test_balanced_is_exact_across_float_magnitudes() -> None:
    # Splitting after 1e300 is the only optimum; naive prefix sums lose the tiny terms.
    assert balanced([1e-300, 1e300, 1e-300, 3.0], 2).boundaries == (0, 2, 4)


_COST = st.one_of(
    st.integers(min_value=0, max_value=1000),
    st.floats(min_value=0, max_value=1e6, allow_nan=False, allow_infinity=False),
)


@settings(max_examples=150, deadline=None)
@given(data=st.data(), costs=st.lists(_COST, min_size=1, max_size=10))
def test_balanced_matches_brute_force_optimum(data: st.DataObject, costs: list[float]) -> None:
    num_stages = data.draw(st.integers(min_value=1, max_value=len(costs)), label="num_stages")
    best = min(max(p.stage_costs(costs)) for p in _all_partitions(len(costs), num_stages))
    part = balanced(costs, num_stages)
    assert part.num_stages == num_stages
    assert part.num_layers == len(costs)
    assert max(part.stage_costs(costs)) == best


@settings(max_examples=150, deadline=None)
@given(data=st.data(), costs=st.lists(st.integers(0, 6), min_size=1, max_size=9))
def test_balanced_picks_smallest_boundaries_among_optima(
    data: st.DataObject, costs: list[int]
) -> None:
    num_stages = data.draw(st.integers(min_value=1, max_value=len(costs)), label="num_stages")
    candidates = _all_partitions(len(costs), num_stages)
    best = min(_exact_max(p, costs) for p in candidates)
    optima = [p.boundaries for p in candidates if _exact_max(p, costs) == best]
    assert balanced(costs, num_stages).boundaries == min(optima)


# --- by_parameters / by_type --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("params", "num_stages", "boundaries"),
    [
        ([100, 5, 5, 5, 5, 100], 3, (0, 1, 5, 6)),
        ([10, 10, 10, 10], 2, (0, 2, 4)),
        ([1, 2, 3, 4, 5, 6, 7, 8, 9], 3, (0, 5, 7, 9)),
        # Exact integers: as floats both splits would cost 2**60 and tie.
        ([1, 2**60, 2], 2, (0, 2, 3)),
    ],
)
def test_by_parameters_table(params: list[int], num_stages: int, boundaries: tuple[int]) -> None:
    assert by_parameters(params, num_stages).boundaries == boundaries


@pytest.mark.parametrize(
    ("pattern", "num_stages", "boundaries"),
    [
        ("block", 4, (0, 3, 5, 7, 11)),
        ("type:Block", 4, (0, 3, 5, 7, 11)),
        ("BLOCK", 2, (0, 5, 11)),
        ("block", 3, (0, 4, 7, 11)),
        ("^(embedding|head)$", 2, (0, 10, 11)),
    ],
)
def test_by_type_spreads_matching_layers_evenly(
    pattern: str, num_stages: int, boundaries: tuple[int, ...]
) -> None:
    assert by_type(KINDS, pattern, num_stages).boundaries == boundaries


@pytest.mark.parametrize(
    ("kinds", "num_stages"),
    [
        (["Embedding"] + ["Block"] * 4 + ["LayerNorm", "Head"], 3),
        (["Embedding"] + ["Block"] * 7 + ["Head"], 3),
        (["Embedding"] + ["Block"] * 8 + ["LayerNorm", "Head"], 3),
        (["Embedding"] + ["Block", "Norm"] * 5 + ["Head"], 4),
        (["Block"] * 5, 5),
    ],
)
def test_by_type_gives_each_stage_the_uniform_count_of_matches(
    kinds: list[str], num_stages: int
) -> None:
    part = by_type(kinds, "block", num_stages)
    counts = [
        sum(kind == "Block" for kind in kinds[a:b]) for a, b in itertools.pairwise(part.boundaries)
    ]
    assert counts == list(uniform(kinds.count("Block"), num_stages).sizes)


def test_by_type_starts_each_later_stage_at_a_matching_layer() -> None:
    kinds = ["Embedding"] + ["Block", "Norm"] * 3 + ["Head"]
    part = by_type(kinds, "block", 3)
    assert part.boundaries == (0, 3, 5, 8)
    assert all(kinds[start] == "Block" for start in part.boundaries[1:-1])


# --- explicit / make_partition ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("given_layout", "boundaries"),
    [
        ((0, 3, 6, 8), (0, 3, 6, 8)),
        ([3, 3, 2], (0, 3, 6, 8)),
        ([8], (0, 8)),
        ((0, 8), (0, 8)),
        ([1, 1, 1, 1, 1, 1, 1, 1], (0, 1, 2, 3, 4, 5, 6, 7, 8)),
    ],
)
def test_explicit_accepts_boundaries_or_balance(
    given_layout: Sequence[int], boundaries: tuple[int, ...]
) -> None:
    assert explicit(given_layout, 8).boundaries == boundaries


@pytest.mark.parametrize(
    ("method", "kwargs", "boundaries"),
    [
        ("uniform", {}, (0, 3, 6, 9, 11)),
        ("Uniform", {}, (0, 3, 6, 9, 11)),
        ("balanced", {"costs": [1] * 11}, (0, 2, 5, 8, 11)),
        ("parameters", {"params": [9, 1, 1, 1, 1, 1, 1, 1, 1, 1, 9]}, (0, 1, 2, 10, 11)),
        ("type:block", {"kinds": KINDS}, (0, 3, 5, 7, 11)),
        ("boundaries:0,2,4,6,11", {}, (0, 2, 4, 6, 11)),
        ("balance:2,2,2,5", {}, (0, 2, 4, 6, 11)),
    ],
)
def test_make_partition_dispatch(
    method: str, kwargs: dict[str, list[int] | list[str]], boundaries: tuple[int, ...]
) -> None:
    part = make_partition(method, num_stages=4, num_layers=11, **kwargs)  # type: ignore[arg-type]
    assert part.boundaries == boundaries


def test_partition_methods_names_every_dispatch_form() -> None:
    assert set(PARTITION_METHODS) == {
        "uniform",
        "parameters",
        "balanced",
        "type",
        "boundaries",
        "balance",
    }


# --- Partition helpers --------------------------------------------------------------------------


def test_balance_round_trip() -> None:
    part = Partition.from_balance([3, 1, 4, 2])
    assert part.boundaries == (0, 3, 4, 8, 10)
    assert part.to_balance() == [3, 1, 4, 2]
    assert part.sizes == (3, 1, 4, 2)
    assert Partition.from_boundaries(part.boundaries) == part


def test_partition_coerces_boundaries_to_a_hashable_tuple() -> None:
    part = Partition(boundaries=[0, 2, 5])  # type: ignore[arg-type]
    assert part.boundaries == (0, 2, 5)
    assert hash(part) == hash(Partition(boundaries=(0, 2, 5)))


def test_partition_counts() -> None:
    part = Partition(boundaries=(0, 3, 6, 8, 10))
    assert (part.num_stages, part.num_layers) == (4, 10)


def test_stage_of_and_layers_of_agree() -> None:
    part = Partition(boundaries=(0, 3, 4, 8, 10))
    assert [part.stage_of(i) for i in range(10)] == [0, 0, 0, 1, 2, 2, 2, 2, 3, 3]
    assert [part.layers_of(s) for s in range(4)] == [
        range(0, 3),
        range(3, 4),
        range(4, 8),
        range(8, 10),
    ]
    for stage in range(part.num_stages):
        assert all(part.stage_of(layer) == stage for layer in part.layers_of(stage))


def test_stage_costs_sums_each_stage() -> None:
    part = Partition(boundaries=(0, 2, 5))
    assert part.stage_costs([1, 2, 3, 4, 5]) == (3.0, 12.0)


def test_describe_has_a_row_per_stage_and_the_imbalance() -> None:
    part = Partition(boundaries=(0, 3, 5, 7, 11))
    text = part.describe(
        costs=[1] + [3] * 8 + [1, 1],
        params=[1_200_000] + [7_000_000] * 8 + [1_000, 1_200_000],
        names=KINDS,
    )
    lines = text.splitlines()
    assert lines[0].split() == ["stage", "layers", "#layers", "params", "cost", "share", "kinds"]
    assert lines[1].split() == ["0", "[0,", "3)", "3", "15.2M", "25.9%", "Embedding..Block"]
    assert lines[2].split() == ["1", "[3,", "5)", "2", "14.0M", "22.2%", "Block"]
    assert lines[3].split() == ["2", "[5,", "7)", "2", "14.0M", "22.2%", "Block"]
    assert lines[4].split() == ["3", "[7,", "11)", "4", "15.2M", "29.6%", "Block..Head"]
    assert lines[5] == "imbalance max/mean (cost): 1.185"


def test_describe_without_costs_measures_imbalance_on_layer_counts() -> None:
    text = uniform(10, 4).describe()
    assert len(text.splitlines()) == 1 + 4 + 1
    assert text.endswith("imbalance max/mean (layers): 1.200")


# --- bad input ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("boundaries", "match"),
    [
        ((0,), r"at least 2 entries"),
        ((), r"at least 2 entries"),
        ((1, 3, 5), r"start at 1: start them at 0"),
        ((0, 3, 3, 6), r"not strictly increasing at index 2 \(3 -> 3\)"),
        ((0, 4, 2), r"not strictly increasing at index 2 \(4 -> 2\)"),
    ],
)
def test_partition_rejects_bad_boundaries(boundaries: tuple[int, ...], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Partition(boundaries=boundaries)


def test_partition_rejects_non_integer_boundaries() -> None:
    with pytest.raises(TypeError, match=r"boundaries\[1\] = 2.5 is not an integer"):
        Partition(boundaries=(0, 2.5, 4))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("balance", "match"),
    [
        ([], r"balance is empty"),
        ([3, 0, 2], r"balance\[1\] = 0 .*at least 1 layer"),
        ([3, -1], r"balance\[1\] = -1"),
    ],
)
def test_from_balance_rejects_empty_stages(balance: list[int], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Partition.from_balance(balance)


_LOOKUP_ERRORS: list[tuple[Callable[[Partition], object], str]] = [
    (lambda p: p.stage_of(10), r"layer 10 is out of range: .*layers 0\.\.9"),
    (lambda p: p.stage_of(-1), r"layer -1 is out of range"),
    (lambda p: p.layers_of(4), r"stage 4 is out of range: .*stages 0\.\.3"),
    (lambda p: p.stage_costs([1.0] * 9), r"costs has 9 entries but the model has 10 layers"),
    (lambda p: p.describe(names=["Block"] * 3), r"names has 3 entries .* 10 layers"),
]


@pytest.mark.parametrize(("call", "match"), _LOOKUP_ERRORS)
def test_partition_lookups_reject_out_of_range(
    call: Callable[[Partition], object], match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        call(uniform(10, 4))


@pytest.mark.parametrize(
    "partitioner",
    [
        lambda s: uniform(6, s),
        lambda s: balanced([1.0] * 6, s),
        lambda s: by_parameters([1] * 6, s),
        lambda s: by_type(["Block"] * 6, "block", s),
        lambda s: make_partition("uniform", num_stages=s, num_layers=6),
    ],
)
def test_more_stages_than_layers_is_rejected(partitioner: Callable[[int], Partition]) -> None:
    match = r"cannot split 6 layers into 8 stages: use at most 6 stages or a model with more"
    with pytest.raises(ValueError, match=match):
        partitioner(8)


@pytest.mark.parametrize("num_stages", [0, -1])
def test_fewer_than_one_stage_is_rejected(num_stages: int) -> None:
    with pytest.raises(ValueError, match=rf"num_stages = {num_stages}: use at least 1 stage"):
        uniform(6, num_stages)
    with pytest.raises(ValueError, match=rf"num_stages = {num_stages}: use at least 1 stage"):
        balanced([1.0] * 6, num_stages)


def test_zero_layers_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"num_layers = 0: a model needs at least one layer"):
        uniform(0, 1)


@pytest.mark.parametrize(
    ("costs", "match"),
    [
        ([], r"costs is empty: give one non-negative cost per layer"),
        ([1.0, -2.0, 3.0], r"costs\[1\] = -2.0 is negative"),
        ([1.0, 2.0, math.nan], r"costs\[2\] = nan is not finite"),
        ([math.inf, 1.0], r"costs\[0\] = inf is not finite"),
        ([1e308, 1e308], r"costs sum beyond the largest float"),
    ],
)
def test_balanced_rejects_bad_costs(costs: list[float], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        balanced(costs, 1)


def test_balanced_rejects_non_numeric_costs() -> None:
    with pytest.raises(TypeError, match=r"costs\[1\] = '2' is not a real number"):
        balanced([1.0, "2"], 1)  # type: ignore[list-item]


def test_by_parameters_names_its_input() -> None:
    with pytest.raises(ValueError, match=r"param_counts\[0\] = -5 is negative"):
        by_parameters([-5, 1], 1)


def test_by_type_needs_a_match_per_stage() -> None:
    match = (
        r"type:layernorm matched 1 of 11 layers but 2 stages need at least one each: "
        r".*kinds seen: Embedding, Block, LayerNorm, Head\)"
    )
    with pytest.raises(ValueError, match=match):
        by_type(KINDS, "layernorm", 2)


def test_by_type_rejects_a_broken_regex() -> None:
    with pytest.raises(ValueError, match=r"type regex '\(block' does not compile"):
        by_type(KINDS, "(block", 2)


@pytest.mark.parametrize(
    ("layout", "match"),
    [
        ((0, 3, 6), r"boundaries \(0, 3, 6\) end at 6 but the model has 8 layers: end them at 8"),
        ((0, 3, 9), r"end at 9 but the model has 8 layers"),
        ((0, 5, 3, 8), r"not strictly increasing at index 2"),
        ([3, 3], r"balance \[3, 3\] covers 6 layers but the model has 8: make the entries sum"),
        ([3, 3, 3], r"covers 9 layers"),
        ([4, -1, 5], r"balance\[1\] = -1"),
        ([], r"explicit partition is empty"),
    ],
)
def test_explicit_rejects_layouts_that_miss_layers(layout: Sequence[int], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        explicit(layout, 8)


@pytest.mark.parametrize(
    ("method", "kwargs", "match"),
    [
        ("gpipe", {}, r"unknown partition method 'gpipe': use one of 'uniform', 'parameters'"),
        ("uniform:3", {}, r"unknown partition method 'uniform:3'"),
        ("balanced", {}, r"'balanced' needs costs: pass costs="),
        ("parameters", {}, r"'parameters' needs params: pass params="),
        ("type:block", {}, r"'type:block' needs kinds: pass kinds="),
        ("balanced", {"costs": [1.0] * 5}, r"costs has 5 entries but num_layers = 8"),
        ("balance:4,4", {}, r"'balance:4,4' describes 2 stages but num_stages = 4"),
        ("balance:3,x,2", {}, r"cannot parse partition method 'balance:3,x,2'"),
        ("boundaries:0,2,4,6", {}, r"end at 6 but the model has 8 layers"),
    ],
)
def test_make_partition_rejects_bad_requests(
    method: str, kwargs: dict[str, list[float]], match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        make_partition(method, num_stages=4, num_layers=8, **kwargs)  # type: ignore[arg-type]


@settings(max_examples=200, deadline=None)
@given(
    kinds=st.lists(st.sampled_from(["Block", "Norm", "Embedding"]), min_size=1, max_size=24),
    data=st.data(),
)
def test_by_type_splits_as_deepspeeds_type_method_does(
    kinds: list[str], data: st.DataObject
) -> None:
    """A DeepSpeed config's `partition_method: type:…` gives the same stages in meshpipe."""
    utils = pytest.importorskip("deepspeed.runtime.utils")
    matched = kinds.count("Block")
    if matched == 0:
        return
    stages = data.draw(st.integers(1, matched))
    weights = [int(kind == "Block") for kind in kinds]
    theirs = tuple(int(b) for b in utils.partition_balanced(weights=weights, num_parts=stages))
    assert by_type(kinds, "type:block", stages).boundaries == theirs


def test_the_memory_method_is_resolved_by_the_memory_model_not_here() -> None:
    from models import layer_specs
    from partitioners import partition_model

    with pytest.raises(ValueError, match="'memory' needs the memory model"):
        partition_model(layer_specs("gpt-tiny"), method="memory", num_stages=2)
