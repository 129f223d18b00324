"""The V-placed schedules on the mesh: two ranks holding stages r and 3 - r equal the
single-process reference bit for bit (the loss is computed on rank 0, which holds the first
and the last stage, and stages 1 and 2 hand off in memory on rank 1)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from engine.schedule.generators import make_schedule
from engine.schedule.simulate import simulate
from tests.dist.cases import Case, reference_run, run_cases
from tests.dist.harness import run_ranks

EXACT = [
    Case("gpt-untied", 2, 1, schedule, 4, "uniform", stages_per_rank=2)
    for schedule in ("zb_v", "v_half", "v_min", "dualpipe_v")
]
TIED = Case("gpt-tiny", 2, 1, "zb_v", 3, "uniform", "sgd", stages_per_rank=2)
"""The embedding (stage 0) and the head (stage 3) share rank 0: one parameter, no tie group."""
DP2 = Case("gpt-untied", 2, 2, "v_min", 2, "uniform", "sgd", stages_per_rank=2)


@pytest.fixture(scope="module")
def runs() -> dict[str, list[dict[str, Any]]]:
    by_case = {}
    for world, cases in ((2, [*EXACT, TIED]), (4, [DP2])):
        per_rank = run_ranks(run_cases, world, cases, timeout_s=600)
        by_case |= {str(case): [rank[str(case)] for rank in per_rank] for case in cases}
    return by_case


def _merged_params(results: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    return {name: value for rank in results for name, value in rank["params"].items()}


@pytest.mark.parametrize("case", EXACT, ids=str)
def test_v_schedules_equal_the_reference_bit_for_bit(
    case: Case, runs: dict[str, list[dict[str, Any]]]
) -> None:
    results, reference = runs[str(case)], reference_run(case)
    for rank in results:
        assert rank["losses"] == reference["losses"]
        assert rank["eval_loss"] == pytest.approx(reference["eval_loss"], rel=1e-6)
    params = _merged_params(results)
    assert params.keys() == reference["params"].keys()
    for name, value in params.items():
        assert torch.equal(value, reference["params"][name]), name


@pytest.mark.parametrize("case", EXACT, ids=str)
def test_v_schedules_keep_the_simulators_stashes(
    case: Case, runs: dict[str, list[dict[str, Any]]]
) -> None:
    schedule = make_schedule(
        case.schedule, num_ranks=2, micro_batches=case.micro_batches, stages_per_rank=2
    )
    predicted = simulate(schedule)
    for results in runs[str(case)]:
        stages = schedule.stages_of(results["pp_rank"])
        assert results["pp_rank"] in (0, 1) and len(stages) == 2
        for peaks in results["peaks"]:
            assert peaks == {s: predicted.in_flight_peak[s] for s in stages}


def test_a_weight_tied_across_the_v_lives_once_on_rank_0(
    runs: dict[str, list[dict[str, Any]]],
) -> None:
    """Not bitwise: the reference adds the head's and the embedding's gradient per
    micro-batch, the shared parameter in the schedule's order."""
    results, reference = runs[str(TIED)], reference_run(TIED)
    assert results[0]["losses"] == pytest.approx(reference["losses"], rel=1e-6)
    for name, value in _merged_params(results).items():
        torch.testing.assert_close(value, reference["params"][name], rtol=1e-6, atol=1e-7)
    assert "layers.0.wte.weight" in results[0]["params"]


def test_v_min_with_two_replicas_matches_the_reference_to_float_tolerance(
    runs: dict[str, list[dict[str, Any]]],
) -> None:
    results, reference = runs[str(DP2)], reference_run(DP2)
    for rank in results:
        assert rank["losses"] == pytest.approx(reference["losses"], rel=1e-5)
        for name, value in rank["params"].items():
            torch.testing.assert_close(value, reference["params"][name], rtol=1e-5, atol=1e-7)
