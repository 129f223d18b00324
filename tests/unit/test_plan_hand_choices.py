"""scripts/plan_hand_choices.py: a mesh's hand choice is 1F1B at the largest micro-batch that
fits the replay, recomputing only where nothing fits without."""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import replace
from pathlib import Path
from types import ModuleType

import pytest

from engine.config import ParallelConfig
from engine.plan import PlanRequest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "plan_hand_choices.py"
_REQUEST = PlanRequest(
    model="gpt-tiny", devices=2, device_memory=2**30, global_batch=8, seq_len=32, device="cpu"
)
_PP2 = ParallelConfig(pp=2, dp=1, tp=1)


@pytest.fixture(scope="module")
def script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("plan_hand_choices", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_a_roomy_budget_takes_the_largest_micro_batch_without_recompute(
    script: ModuleType,
) -> None:
    plan, peak = script._hand_choice(_REQUEST, _PP2)
    c = plan.candidate
    assert (c.schedule, c.micro_batch_size, c.micro_batches, c.recompute) == ("1f1b", 8, 1, ())
    assert peak <= _REQUEST.device_memory


def test_a_budget_below_the_largest_micro_batch_takes_the_next(script: ModuleType) -> None:
    smaller = replace(_REQUEST, micro_batch_sizes=(4,))
    _, peak = script._hand_choice(smaller, _PP2)
    tight = replace(_REQUEST, device_memory=peak)
    chosen, _ = script._hand_choice(tight, _PP2)
    assert (chosen.candidate.micro_batch_size, chosen.candidate.recompute) == (4, ())


def test_a_budget_nothing_fits_without_recompute_recomputes_every_stage(
    script: ModuleType,
) -> None:
    one = replace(_REQUEST, micro_batch_sizes=(1,))
    plan, plain = script._hand_choice(one, _PP2)
    recomputed = replace(plan.candidate, recompute=(0, 1))
    peak = script._replayed_peak(one, script.predict(one, recomputed))
    assert peak < plain
    chosen, _ = script._hand_choice(replace(one, device_memory=peak), _PP2)
    assert chosen.candidate.recompute == (0, 1)


def test_a_budget_nothing_fits_gives_none(script: ModuleType) -> None:
    assert script._hand_choice(replace(_REQUEST, device_memory=1000), _PP2) is None
