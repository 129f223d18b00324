"""Packed documents through the pipeline equal the single-process reference on the same
packed batch: the document ids reach every stage from the batch (no new message, no new
shape), including a backward that recomputes its stage's forward. A packed run with
validation trains and evaluates on pp 2 × dp 2 as in one process."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from engine.training.config import TrainConfig
from engine.training.loop import train
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


def _documents_file(path: Path) -> str:
    """80 documents of 3 to 20 tokens, each ending with the EOS token 0."""
    lengths = np.random.default_rng(0).integers(3, 21, size=80)
    tokens = [t for k, n in enumerate(lengths) for t in [k + 1] * (n - 1) + [0]]
    path.with_suffix(".bin").write_bytes(np.asarray(tokens, dtype=np.uint8).tobytes())
    header = {"format": "meshpipe-tokens", "version": 1, "dtype": "uint8", "vocab_size": 256}
    header |= {"num_tokens": len(tokens), "eos_id": 0}
    path.with_suffix(".json").write_text(json.dumps(header))
    return str(path)


def _trained(rank: int, world_size: int, config: TrainConfig) -> tuple[Any, ...]:
    result = train(config, progress=False)
    return result.losses, result.val_loss


def test_a_packed_run_with_validation_on_pp2_dp2_equals_one_process(tmp_path: Path) -> None:
    run = {
        "model": "gpt-tiny",
        "steps": 2,
        "global_batch": 4,
        "micro_batches": 2,
        "seq_len": 16,
        "data": _documents_file(tmp_path / "docs"),
        "val_fraction": 0.2,
        "eval_every": 1,
        "eval_batches": 2,
        "pack_documents": True,
        "threads": 1,
    }
    single = train(TrainConfig.of(**run), progress=False)
    assert single.val_loss is not None
    for losses, val_loss in run_ranks(_trained, 4, TrainConfig.of(**run, pp=2, dp=2)):
        assert losses == pytest.approx(single.losses, rel=1e-5)
        assert val_loss == pytest.approx(single.val_loss, rel=1e-5)
