"""A pipelined step equals the single-process reference: every schedule, every partition.

Each world size is spawned once (a module fixture) and runs all its cases; each test then
checks one behaviour of one case against `reference_run`.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch

from engine.schedule.generators import make_schedule
from engine.schedule.simulate import simulate
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
SPLIT_AND_VIRTUAL = [
    Case("gpt-untied", 2, 1, "zb_h1", m, "uniform") for m in (1, 2, 4)
] + [
    Case("gpt-untied", 2, 1, "zb_h2", m, "balanced") for m in (2, 4)
] + [
    Case("gpt-untied", 2, 1, "interleaved_1f1b", m, "uniform", stages_per_rank=2) for m in (2, 4)
] + [
    Case("gpt-untied", 2, 1, "looped_bfs", m, "uniform", stages_per_rank=2) for m in (1, 3)
] + [Case("llama", 2, 1, schedule, 4, "uniform") for schedule in ("zb_h1", "zb_h2")]
# Without the non-finite guard steps follow each other with no barrier (clip and fp16 off).
UNGUARDED = [
    Case("gpt-untied", 2, 1, "zb_drain", m, "balanced", guard=False) for m in (1, 2, 4, 8)
] + [
    Case("gpt-untied", 2, 1, schedule, 4, "uniform", guard=False) for schedule in ("1f1b", "zb_h2")
] + [Case("llama", 2, 1, "zb_drain", 4, "uniform", guard=False)]
P4_UNGUARDED = [
    Case("gpt-untied", 4, 1, schedule, 8, "uniform", guard=False)
    for schedule in ("zb_drain", "zb_h1")
] + [Case("gpt-deep", 4, 1, "interleaved_1f1b", 4, "uniform", stages_per_rank=2, guard=False)]
P4_SPLIT_AND_VIRTUAL = [
    Case("gpt-untied", 4, 1, schedule, m, "uniform")
    for schedule, m in (("zb_h1", 4), ("zb_h1", 8), ("zb_h2", 4), ("zb_h2", 8))
] + [
    Case("gpt-deep", 4, 1, "interleaved_1f1b", m, "uniform", stages_per_rank=2) for m in (4, 8)
] + [Case("gpt-deep", 4, 1, "looped_bfs", 4, "uniform", stages_per_rank=2)]
DP_CASES = [Case("gpt-untied", 2, 2, schedule, 2, "uniform", "sgd") for schedule in SCHEDULES]
DP_CASES += [Case("gpt-untied", 2, 2, "zb_h1", 4, "uniform", "sgd")]
DP_CASES += [Case("gpt-untied", 2, 2, "zb_drain", 4, "uniform", "sgd", guard=False)]
TIED_CASES = [
    Case("gpt-tiny", 2, 1, schedule, 2, "uniform", "sgd") for schedule in ("gpipe", "1f1b", "zb_h1")
] + [Case("gpt-tiny", 2, 1, "interleaved_1f1b", 2, "uniform", "sgd", stages_per_rank=2)]
EXACT_CASES = (
    P2_CASES + P4_CASES + SPLIT_AND_VIRTUAL + P4_SPLIT_AND_VIRTUAL + UNGUARDED + P4_UNGUARDED
)


@pytest.fixture(scope="module")
def runs() -> dict[str, list[dict[str, Any]]]:
    """Every case's per-rank results, from one 2-rank and one 4-rank world."""
    by_case: dict[str, list[dict[str, Any]]] = {}
    worlds = (
        (2, P2_CASES + SPLIT_AND_VIRTUAL + TIED_CASES + UNGUARDED),
        (4, P4_CASES + P4_SPLIT_AND_VIRTUAL + DP_CASES + P4_UNGUARDED),
    )
    for world, cases in worlds:
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
    params = [rank["params"] for rank in results]
    head = next(p["layers.6.weight"] for p in params if "layers.6.weight" in p)
    embedding = next(p["layers.0.wte.weight"] for p in params if "layers.0.wte.weight" in p)
    assert torch.equal(head, embedding)


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
    schedule = make_schedule(
        case.schedule,
        num_ranks=case.pp,
        micro_batches=case.micro_batches,
        stages_per_rank=case.stages_per_rank,
    )
    predicted = simulate(schedule)
    for results in runs[str(case)]:
        stages = schedule.stages_of(results["pp_rank"])
        for step_peaks, step_pending in zip(results["peaks"], results["pending_w"], strict=True):
            assert step_peaks == {s: predicted.in_flight_peak[s] for s in stages}
            assert step_pending == {s: predicted.pending_w_peak[s] for s in stages}


VIRTUAL = [c for c in EXACT_CASES if c.stages_per_rank > 1]


@pytest.mark.parametrize("case", EXACT_CASES[:4] + DP_CASES + VIRTUAL, ids=str)
def test_eval_step_returns_the_reference_loss_on_every_rank(
    case: Case, runs: dict[str, list[dict[str, Any]]]
) -> None:
    reference = reference_run(case)
    for rank in runs[str(case)]:
        assert rank["eval_loss"] == pytest.approx(reference["eval_loss"], rel=1e-6)


@pytest.mark.parametrize("case", UNGUARDED + P4_UNGUARDED, ids=str)
def test_unguarded_steps_report_the_guarded_runs_grad_norm_on_every_rank(
    case: Case, runs: dict[str, list[dict[str, Any]]]
) -> None:
    """The norm of a barrier-free step arrives late, from every rank's per-parameter norms
    summed by global position (adding zeros is exact): the reference's norm, bit for bit."""
    reference = reference_run(case)
    for rank in runs[str(case)]:
        assert rank["grad_norms"] == reference["grad_norms"]


def test_bubble_is_reported_between_zero_and_one(runs: dict[str, list[dict[str, Any]]]) -> None:
    for results in runs.values():
        for rank in results:
            assert all(0.0 <= b < 1.0 for b in rank["bubbles"])
