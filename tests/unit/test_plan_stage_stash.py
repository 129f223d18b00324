"""The screen's stash of a stage, summed from its layers traced alone, is the replay's: a hidden
state between two layers of a stage is counted once (`budget._shared_per_stage`)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from engine.config import ParallelConfig
from engine.memory.estimate import MemoryConfig, estimate_memory
from engine.plan.budget import _stage_parts
from engine.plan.candidates import Candidate
from engine.plan.context import SearchContext
from engine.plan.request import PlanRequest, layout_fields

_PP3 = Candidate(
    mesh=ParallelConfig(pp=3, dp=1, tp=1),
    schedule="1f1b",
    stages_per_rank=1,
    micro_batches=6,
    micro_batch_size=1,
)


@pytest.mark.parametrize(
    ("model", "precision"), [("llama-tiny", "bf16"), ("gpt-tiny", "bf16"), ("llama-tiny", "fp32")]
)
def test_a_stages_stash_summed_from_its_layers_is_the_replays_less_its_received_input(
    model: str, precision: str
) -> None:
    request = PlanRequest(
        model=model,
        devices=3,
        device_memory=2**40,
        global_batch=6,
        seq_len=64,
        device="cpu",
        precision=precision,
    )
    state = SearchContext(request)
    bounds = state.boundaries(3)
    assert min(b - a for a, b in itertools.pairwise(bounds)) >= 2  # layers meet inside each stage
    sums = state.sums(_PP3)
    one = np.ones(3, dtype=np.int64)
    screened = _stage_parts(
        sums,
        bounds,
        before=one,
        after=one,
        micro_batch_size=1,
        recomputed=np.zeros(3, dtype=bool),
        every=0,
        reduce_copy=False,
        held=0 * one,
    ).kept
    fields = layout_fields(request, _PP3, bounds)
    replayed = estimate_memory(MemoryConfig.of(device="cpu", **fields)).stages
    received = [0, sums.received, sums.received]  # the first stage receives tokens
    assert screened.tolist() == [
        s.kept_per_micro_batch - r for s, r in zip(replayed, received, strict=True)
    ]
