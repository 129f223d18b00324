"""A pipelined step equals the single-process reference: every schedule, every partition.

Each world size is spawned once (a module fixture) and runs all its cases; each test then
checks one behaviour of one case against `reference_run`.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch

from engine.passes import add_communication
from engine.schedules import make_schedule
from engine.validate import simulate
from tests.dist.cases import Case, reference_run, run_cases
from tests.dist.harness import run_ranks

SCHEDULES = ("gpipe", "1f1b")
P2_CASES = [
    Case("gpt-untied", 2, 1, schedule, m, partition)
    for schedule, m, partition in itertools.product(
        SCHEDULES, (1, 2, 4), ("uniform", "balanced", "boundaries:0,1,7", "boundaries:0,5,7")
    )
] + [Case("llama", 2, 1, schedule, 3, "uniform") for schedule in SCHEDULES]
P4_CASES = [
    Case("gpt-untied", 4, 1, schedule, m, partition)
    for schedule, m, partition in itertools.product(
        SCHEDULES, (2, 4, 8), ("uniform", "balanced", "boundaries:0,1,2,3,7")
    )
]
DP_CASES = [Case("gpt-untied", 2, 2, schedule, 2, "uniform", "sgd") for schedule in SCHEDULES]
TIED_CASES = [Case("gpt-tiny", 2, 1, schedule, 2, "uniform", "sgd") for schedule in SCHEDULES]
EXACT_CASES = P2_CASES + P4_CASES


@pytest.fixture(scope="module")
def runs() -> dict[str, list[dict[str, Any]]]:
    """Every case's per-rank results, from one 2-rank and one 4-rank world."""
    by_case: dict[str, list[dict[str, Any]]] = {}
    for world, cases in ((2, P2_CASES + TIED_CASES), (4, P4_CASES + DP_CASES)):
        per_rank = run_ranks(run_cases, world, cases)
        for case in cases:
            by_case[str(case)] = [rank_results[str(case)] for rank_results in per_rank]
    return by_case


def _merged_params(results: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    merged: dict[str, torch.Tensor] = {}
    for rank in results:
        if rank["dp_rank"] == 0:
            merged.update(rank["params"])
    return merged


@pytest.mark.parametrize("case", EXACT_CASES, ids=str)
def test_dp1_losses_and_parameters_equal_the_reference_bit_for_bit(
    case: Case, runs: dict[str, list[dict[str, Any]]]
) -> None:
    results, reference = runs[str(case)], reference_run(case)
    for rank in results:
        assert rank["losses"] == reference["losses"]
    params = _merged_params(results)
    assert params.keys() == reference["params"].keys()
    for name, value in params.items():
        assert torch.equal(value, reference["params"][name]), name


@pytest.mark.parametrize("case", TIED_CASES, ids=str)
def test_tied_embedding_on_two_stages_matches_the_reference_to_1e6(
    case: Case, runs: dict[str, list[dict[str, Any]]]
) -> None:
    """Not bitwise: the reference sums the head's and the embedding's gradient per micro-batch
    (h0 + e0 + h1 + e1), the pipeline per stage first ((h0 + h1) + (e0 + e1))."""
    results, reference = runs[str(case)], reference_run(case)
    assert results[0]["losses"] == pytest.approx(reference["losses"], rel=1e-6)
    for name, value in _merged_params(results).items():
        torch.testing.assert_close(value, reference["params"][name], rtol=1e-6, atol=1e-7)
    head, embedding = results[-1]["params"]["layers.6.weight"], results[0]["params"]
    assert torch.equal(head, embedding["layers.0.wte.weight"])


@pytest.mark.parametrize("case", DP_CASES, ids=str)
def test_dp2_pp2_matches_the_reference_to_float_tolerance(
    case: Case, runs: dict[str, list[dict[str, Any]]]
) -> None:
    results, reference = runs[str(case)], reference_run(case)
    for rank in results:
        assert rank["losses"] == pytest.approx(reference["losses"], rel=1e-5)
    for rank in results:
        for name, value in rank["params"].items():
            torch.testing.assert_close(value, reference["params"][name], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("case", EXACT_CASES + DP_CASES, ids=str)
def test_measured_in_flight_peak_equals_the_simulator(
    case: Case, runs: dict[str, list[dict[str, Any]]]
) -> None:
    schedule = add_communication(
        make_schedule(case.schedule, num_ranks=case.pp, micro_batches=case.micro_batches)
    )
    predicted = simulate(schedule).in_flight_peak
    for rank, results in enumerate(runs[str(case)]):
        for step_peaks in results["peaks"]:
            assert step_peaks == {rank % case.pp: predicted[rank % case.pp]}


@pytest.mark.parametrize("case", EXACT_CASES[:4] + DP_CASES, ids=str)
def test_eval_step_returns_the_reference_loss_on_every_rank(
    case: Case, runs: dict[str, list[dict[str, Any]]]
) -> None:
    reference = reference_run(case)
    for rank in runs[str(case)]:
        assert rank["eval_loss"] == pytest.approx(reference["eval_loss"], rel=1e-6)


def test_bubble_is_reported_between_zero_and_one(runs: dict[str, list[dict[str, Any]]]) -> None:
    for results in runs.values():
        for rank in results:
            assert all(0.0 <= b < 1.0 for b in rank["bubbles"])
