"""The planner's split backward: how much of each stage's backward is I and how much W."""

from __future__ import annotations

from dataclasses import replace

import pytest

import engine.plan.profile
from engine.config import ParallelConfig
from engine.plan import PlanRequest, measured_input_shares
from engine.plan.candidates import Candidate
from engine.plan.context import SearchContext
from engine.plan.hardware import Hardware
from engine.plan.search import predict
from engine.plan.timing import input_share, layer_flops, stage_times
from engine.runtime.stage import PipelineStage
from engine.training.config import TrainConfig
from engine.training.preflight import stage_partition, whole_backward_note
from models import layer_specs

SEQ = 32
GPT = layer_specs("gpt-tiny")  # embedding, 4 blocks, final norm, head tied to the embedding
BLOCK, HEAD = 1, len(GPT) - 1


def _times(layers: range, *, recompute: bool = False, shares: float | None = None) -> object:
    forward = [1.0] * len(GPT)
    return stage_times(
        forward,
        GPT,
        layers,
        hardware=Hardware(),
        activation_bytes=0,
        tp=1,
        recompute=recompute,
        input_shares=[input_share(s, SEQ) if shares is None else shares for s in GPT],
    )


def test_a_blocks_input_gradient_is_its_backward_less_the_linears_weight_gemms() -> None:
    spec = GPT[BLOCK]
    linear_weights = sum(
        p.numel()
        for name, p in spec.build().named_parameters()
        if name.endswith("weight") and p.dim() == 2
    )
    weight_flops = 2 * SEQ * linear_weights  # gᵀ·x: as many FLOPs as the forward GEMMs
    expected = 1 - weight_flops / (2 * layer_flops(spec, SEQ))
    assert input_share(spec, SEQ) == pytest.approx(expected)
    assert input_share(spec, SEQ) > 0.5  # attention's scores have no weights: all at I


def test_attention_moves_more_of_a_blocks_backward_to_i_as_the_sequence_grows() -> None:
    assert input_share(GPT[BLOCK], 4 * SEQ) > input_share(GPT[BLOCK], SEQ)


def test_a_heads_backward_splits_evenly_and_a_norms_and_an_embeddings_are_all_input() -> None:
    assert input_share(GPT[HEAD], SEQ) == pytest.approx(0.5)
    assert input_share(GPT[HEAD - 1], SEQ) == 1.0  # the final norm
    assert input_share(GPT[0], SEQ) == 1.0  # a lookup: its gradient is taken at I


def test_a_stage_defers_its_linears_weight_gradients_to_w() -> None:
    layers = range(BLOCK, HEAD)
    times = _times(layers, shares=0.75)
    assert times.weight_grad == pytest.approx(2 * len(layers) * 0.25)  # forwards of 1 s
    assert times.input_grad + times.weight_grad == pytest.approx(times.backward)


def test_a_stage_that_recomputes_runs_its_whole_backward_at_i() -> None:
    times = _times(range(BLOCK, HEAD), recompute=True)
    assert times.weight_grad == 0.0
    assert times.input_grad == times.backward


def test_a_stage_holding_both_ends_of_a_tie_runs_its_whole_backward_at_i() -> None:
    assert _times(range(0, len(GPT))).weight_grad == 0.0
    assert _times(range(BLOCK, len(GPT))).weight_grad > 0.0  # the head alone: its tie is apart


@pytest.mark.parametrize(
    ("layers", "recompute"),
    [(range(BLOCK, HEAD), "none"), (range(BLOCK, HEAD), "full"), (range(0, len(GPT)), "none")],
)
def test_the_model_defers_weight_gradients_where_the_engine_does(
    layers: range, recompute: str
) -> None:
    stage = PipelineStage(
        GPT, stage=0, layers=layers, num_stages=1, seed=0, device="meta", recompute=recompute
    )
    stage.enable_split_backward()
    deferred = _times(layers, recompute=recompute != "none").weight_grad > 0
    assert deferred == (not stage._fused_weight_grads)


def _zb_h1(recompute: tuple[int, ...] = ()) -> Candidate:
    return Candidate(
        mesh=ParallelConfig(pp=2, dp=1, tp=1),
        schedule="zb_h1",
        stages_per_rank=1,
        micro_batches=8,
        micro_batch_size=1,
        recompute=recompute,
    )


SMALL = PlanRequest(
    model="gpt-tiny", devices=2, device_memory=2**30, global_batch=8, seq_len=SEQ, top=1
)


def test_measured_shares_are_used_where_given_and_flops_elsewhere() -> None:
    layers = len(GPT)
    measured = tuple(0.9 for _ in range(layers))
    context = SearchContext(replace(SMALL, measured_input_shares={1: measured}))
    assert context.input_shares(1) == measured
    assert context.input_shares(2) == tuple(input_share(s, SEQ) for s in GPT)


def test_a_zero_bubble_step_is_longer_when_more_of_the_backward_is_i() -> None:
    """I is on the critical path (the gradient the previous stage waits for); W fills gaps."""

    def step(share: float) -> float:
        request = replace(SMALL, measured_input_shares={1: tuple(share for _ in GPT)})
        return predict(request, _zb_h1()).step_time

    assert step(0.9) > step(0.5)


def test_a_recomputing_zero_bubble_step_does_not_depend_on_the_split() -> None:
    def step(share: float) -> float:
        request = replace(SMALL, measured_input_shares={1: tuple(share for _ in GPT)})
        return predict(request, _zb_h1(recompute=(0, 1))).step_time

    assert step(0.9) == step(0.5)


def test_measured_shares_time_each_distinct_layer_once(monkeypatch: pytest.MonkeyPatch) -> None:
    profiled: list[int] = []
    profile = engine.plan.profile._profile_stage

    def counted(*args: object, **kwargs: object) -> tuple[float, float, float, float]:
        profiled.append(args[1])  # type: ignore[arg-type]
        return profile(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(engine.plan.profile, "_profile_stage", counted)
    shares = measured_input_shares(GPT, 1, SEQ, repeats=1)
    assert profiled == [0, BLOCK, HEAD - 1, HEAD]  # the second block is the first's spec
    assert len(shares) == len(GPT) and shares[BLOCK] == shares[BLOCK + 1]
    assert all(0.0 <= share <= 1.0 for share in shares)


def _note(**flags: object) -> str | None:
    base: dict[str, object] = {"model": "gpt-tiny", "pp": 2, "micro_batches": 4}
    config = TrainConfig.of(**{**base, "global_batch": 8, "seq_len": SEQ, **flags})
    return whole_backward_note(config, stage_partition(config, GPT), GPT)


def test_the_launcher_says_which_stages_of_a_split_schedule_run_no_w() -> None:
    note = _note(schedule="zb_h1", recompute="full")
    assert note is not None
    assert "stage 1 recomputes" in note and "W are empty" in note  # stage 0's backward is fused
    assert "--recompute-stages" in note


def test_the_launcher_says_nothing_where_every_split_stage_defers_its_w() -> None:
    assert _note(schedule="zb_h1") is None
    assert _note(schedule="zb_h1", recompute="full", recompute_stages=(0,)) is None
    assert _note(schedule="1f1b", recompute="full") is None  # no W to begin with
