"""Packed documents through the pipeline equal the single-process reference on the same
packed batch: the document ids reach every stage from the batch (no new message, no new
shape), including a backward that recomputes its stage's forward. (A packed run with validation on
pp 2 × dp 2 against one process: tests/dist/test_real_data.py.)"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch

from tests.dist.cases import Case, reference_run, run_cases
from tests.dist.harness import run_ranks

PACKED = [
    Case("gpt-untied", 2, 1, "1f1b", 2, "uniform", recompute="full", documents=True),
    Case("llama", 2, 1, "zb_h1", 2, "uniform", documents=True),
]


@pytest.fixture(scope="module")
def runs() -> dict[str, list[dict[str, Any]]]:
    per_rank = run_ranks(run_cases, 2, PACKED, timeout_s=600)
    return {str(case): [rank[str(case)] for rank in per_rank] for case in PACKED}


@pytest.fixture(scope="module")
def references() -> dict[str, dict[str, Any]]:
    return {str(case): reference_run(case) for case in PACKED}


@pytest.mark.parametrize("case", PACKED, ids=str)
def test_packed_training_equals_the_reference_bit_for_bit(
    case: Case, runs: dict[str, list[dict[str, Any]]], references: dict[str, dict[str, Any]]
) -> None:
    results, reference = runs[str(case)], references[str(case)]
    for rank in results:
        assert rank["losses"] == reference["losses"]
    params = {name: p for rank in results for name, p in rank["params"].items()}
    assert params.keys() == reference["params"].keys()
    for name, value in params.items():
        assert torch.equal(value, reference["params"][name]), name


@pytest.mark.parametrize("case", PACKED, ids=str)
def test_packed_evaluation_equals_the_reference_on_every_rank(
    case: Case, runs: dict[str, list[dict[str, Any]]], references: dict[str, dict[str, Any]]
) -> None:
    reference = references[str(case)]
    for rank in runs[str(case)]:
        assert rank["eval_loss"] == pytest.approx(reference["eval_loss"], rel=1e-6)


def test_packing_changes_the_loss(runs: dict[str, list[dict[str, Any]]]) -> None:
    """The ids are used: the same batch scored as whole rows gives another loss."""
    case = PACKED[0]
    unpacked = reference_run(replace(case, documents=False))
    assert runs[str(case)][0]["losses"][0] != pytest.approx(unpacked["losses"][0], rel=1e-4)
