"""Tensor parallelism inside pipeline stages equals the single-process reference to float
tolerance: gpt-tiny (embedding tied to the head) and llama-tiny (grouped kv heads) at tp 2 alone,
at pp 2 × tp 2, and on the full pp × dp × tp = 2 × 2 × 2 grid, with and without sequence
parallelism; checkpoints keep full tensors under global names, so a tp 2 checkpoint loads at tp 1
and back.

Tolerance: the row-wise layers sum partial products over the tp ranks and the loss is taken
over vocabulary shards, so the arithmetic differs from one process in its order of additions
only. After 2 SGD steps losses agree to rel 1e-6 and every parameter to rtol 1e-5 / atol 1e-7
(measured: losses within 9e-8 relative, parameters within 7.5e-9 absolute; the same under
sequence parallelism, whose reduce-scatters and gathers change no sum's order further).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from engine.checkpoint import TrainerState, load_checkpoint, save_checkpoint
from engine.comm.mesh import init_mesh
from engine.config import EngineOptions, OptimizerSpec
from engine.parallel import full_tensor
from engine.runtime.clipping import global_parameter_order
from engine.runtime.engine import PipelineEngine
from partitioners import partition_model
from tests.dist.cases import SEQ_LEN, Case, model_specs, reference_run, run_cases
from tests.dist.harness import run_ranks


def _tp2(
    model: str, pp: int, dp: int, schedule: str = "1f1b", micro_batches: int = 2, **options: Any
) -> Case:
    """A tp 2 case with SGD per tensor (torch's fused SGD kernel has no DTensor rule; fused
    AdamW has), unless it says otherwise (ZeRO-1/2 step plain flat shards: fused runs)."""
    options.setdefault("optimizer_impl", "per_tensor")
    return Case(model, pp, dp, schedule, micro_batches, "uniform", "sgd", tp=2, **options)


TP2 = [_tp2(model, 1, 1) for model in ("gpt-tiny", "llama")]
# Recomputation re-runs the layers' collectives in backward; clipping needs the global norm.
TP2 += [_tp2("llama", 1, 1, clip=0.5, recompute="full")]
# Regional compilation of DTensor layers (the plans' hooks run inside each compiled layer).
TP2 += [_tp2("llama", 1, 1, compile=True)]
PP2_TP2 = [_tp2(model, 2, 1) for model in ("gpt-tiny", "llama")]
# Two stages per rank (GPT's tied embedding and head on different ranks), and steps without
# a barrier (the grad norm read late from every rank's per-parameter norms).
PP2_TP2 += [
    _tp2("gpt-tiny", 2, 1, "interleaved_1f1b", 4, stages_per_rank=2),
    _tp2("llama", 2, 1, "gpipe", guard=False),
]
# The split backward: I through autograd, W as each shard's own GEMM on local tensors.
SPLIT = [_tp2("gpt-tiny", 2, 1, "zb_h1", 4)]
PP2_TP2 += SPLIT
GRID = [_tp2("gpt-tiny", 2, 2)]
# Autocast rounds each GEMM's output to 16 bits; tp changes the order of the row-wise sums, so
# the rounding differs more than in fp32: measured within 1.2e-5 (losses, relative) and 2.7e-5
# (parameters, absolute).
LOW_PRECISION = [_tp2("gpt-tiny", 1, 1, precision="fp16")]
PP2_LOW_PRECISION = [_tp2(model, 2, 1, precision="bf16") for model in ("gpt-tiny", "llama")]
SPLIT += [_tp2("llama", 2, 1, "zb_drain", 4, guard=False, precision="bf16")]
PP2_LOW_PRECISION += SPLIT[1:]
NAN = [_tp2("gpt-untied", 2, 1, nan_at_step=1)]  # stage 0's output poisoned in step 1
# ZeRO-3 over the (dp, tp) mesh: FSDP2 shards each tp shard over the replicas; clipping sums the
# squares over both dims (tp only for the split weights), the tie crosses stages at pp 2.
ZERO3 = [
    _tp2("llama", 1, 2, clip=0.5, zero=3),
    _tp2("gpt-tiny", 2, 2, clip=0.5, zero=3),
    _tp2("gpt-untied", 1, 2, zero=3),  # unclipped: its published norm is the reference's
]
# FSDP casts every parameter (norms and embeddings too) where autocast leaves them fp32:
# measured within 7e-5 (bf16) and 1e-6 (fp16) of the reference's parameters.
ZERO3_LOW_PRECISION = [
    _tp2("gpt-untied", 1, 2, precision="bf16", zero=3, zero_reshard="micro-batch"),
    _tp2("llama", 1, 2, precision="fp16", zero=3, recompute="full"),
    _tp2("llama", 2, 2, "zb_h1", 4, precision="bf16", zero=3),
]
# ZeRO-1/2 over the (dp, tp) mesh: each tp rank's flat buffers of its local shards, sharded
# over the replicas of its tp slice; fused SGD steps the flat shards. On the grid, the tie
# crosses stages (ZeRO-2 sums it before the reduce-scatter) under the split backward, and fp16
# scales the loss under recompute.
ZERO12 = [
    _tp2("gpt-tiny", 1, 2, clip=0.5, zero=1, optimizer_impl="fused"),
    _tp2("gpt-untied", 1, 2, zero=2),  # unclipped: its published norm is the reference's
    _tp2("gpt-tiny", 2, 2, "zb_h1", 4, clip=0.5, zero=2),
]
ZERO12_LOW_PRECISION = [
    _tp2("llama", 1, 2, precision="bf16", zero=2, clip=0.5),
    _tp2("llama", 2, 2, precision="fp16", zero=1, recompute="full"),
]
# Sequence parallelism: norms and the residual stream on 1/tp of the sequence, each norm weight's
# gradient summed over the tp ranks; GPT's learned positions looked up per shard, its embedding
# tied to the head on the other stage; the split backward's W on the reduce-scattered layers.
SEQUENCE = [_tp2(model, 1, 1, sequence_parallel=True) for model in ("gpt-tiny", "llama")]
PP2_SEQUENCE = [_tp2(model, 2, 1, sequence_parallel=True) for model in ("gpt-tiny", "llama")]
PP2_SEQUENCE += [_tp2("gpt-tiny", 2, 1, "zb_h1", 4, sequence_parallel=True)]
ZERO3_SEQUENCE = [_tp2("llama", 1, 2, clip=0.5, zero=3, sequence_parallel=True)]
# The 8-rank ZeRO-3 cases share the grid's launch (8 processes are costly to start on 2 cores);
# the 4-rank ones have a launch of their own, so each fixture stays within one test's timeout.
WORLDS = (
    (2, TP2 + LOW_PRECISION + SEQUENCE),
    (4, PP2_TP2 + PP2_LOW_PRECISION + NAN + PP2_SEQUENCE),
    (8, GRID + ZERO3[1:2] + ZERO3_LOW_PRECISION[2:] + ZERO12[2:] + ZERO12_LOW_PRECISION[1:]),
)
ZERO3_WORLD = ZERO3[::2] + ZERO3_LOW_PRECISION[:2] + ZERO12[:2] + ZERO12_LOW_PRECISION[:1]
ZERO3_WORLDS = ((4, ZERO3_WORLD + ZERO3_SEQUENCE),)
SEQUENCE_CASES = SEQUENCE + PP2_SEQUENCE + ZERO3_SEQUENCE
LOSS_RTOL, PARAM_RTOL, PARAM_ATOL = 1e-6, 1e-5, 1e-7
LOW_LOSS_RTOL, LOW_PARAM_ATOL = 1e-4, 1e-4
ZERO3_PARAM_ATOL = 5e-4


def _run_worlds(worlds: tuple[tuple[int, list[Case]], ...]) -> dict[str, list[dict[str, Any]]]:
    by_case: dict[str, list[dict[str, Any]]] = {}
    for world, cases in worlds:
        per_rank = run_ranks(run_cases, world, cases)
        for case in cases:
            by_case[str(case)] = [rank_results[str(case)] for rank_results in per_rank]
    return by_case


@pytest.fixture(scope="module")
def runs() -> dict[str, list[dict[str, Any]]]:
    return _run_worlds(WORLDS)


@pytest.fixture(scope="module")
def zero3_runs() -> dict[str, list[dict[str, Any]]]:
    return _run_worlds(ZERO3_WORLDS)


def _results(case: Case, request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    """Each rank's results of `case`, from the fixture that ran it."""
    own = any(case in cases for _, cases in ZERO3_WORLDS)
    runs = request.getfixturevalue("zero3_runs" if own else "runs")
    return list(runs[str(case)])


@pytest.mark.parametrize("case", TP2 + PP2_TP2 + GRID + ZERO3 + ZERO12 + SEQUENCE_CASES, ids=str)
def test_tensor_parallel_losses_equal_the_reference_to_float_tolerance(
    case: Case, request: pytest.FixtureRequest
) -> None:
    reference = reference_run(case)
    for rank in _results(case, request):
        assert rank["losses"] == pytest.approx(reference["losses"], rel=LOSS_RTOL)
        assert rank["eval_loss"] == pytest.approx(reference["eval_loss"], rel=LOSS_RTOL)


@pytest.mark.parametrize("case", LOW_PRECISION + PP2_LOW_PRECISION, ids=str)
def test_bf16_and_fp16_tensor_parallel_runs_equal_the_reference_to_their_rounding(
    case: Case, runs: dict[str, list[dict[str, Any]]]
) -> None:
    reference = reference_run(case)
    for rank in runs[str(case)]:
        assert rank["losses"] == pytest.approx(reference["losses"], rel=LOW_LOSS_RTOL)
        for name, value in rank["params"].items():
            expected = reference["params"][name]
            torch.testing.assert_close(value, expected, rtol=0, atol=LOW_PARAM_ATOL)


@pytest.mark.parametrize("case", ZERO3_LOW_PRECISION + ZERO12_LOW_PRECISION, ids=str)
def test_bf16_and_fp16_under_tp_and_zero_equal_the_reference_to_their_rounding(
    case: Case, request: pytest.FixtureRequest
) -> None:
    reference = reference_run(case)
    atol = ZERO3_PARAM_ATOL if case.zero == 3 else LOW_PARAM_ATOL  # ZeRO-1/2 cast as autocast
    for rank in _results(case, request):
        assert rank["losses"] == pytest.approx(reference["losses"], rel=LOW_LOSS_RTOL)
        for name, value in rank["params"].items():
            expected = reference["params"][name]
            torch.testing.assert_close(value.float(), expected, rtol=0, atol=atol)


@pytest.mark.parametrize("case", TP2 + PP2_TP2 + GRID + ZERO3 + ZERO12 + SEQUENCE_CASES, ids=str)
def test_every_ranks_full_parameters_equal_the_reference_to_float_tolerance(
    case: Case, request: pytest.FixtureRequest
) -> None:
    """Each rank's shards, gathered: every tp rank and replica holds its slice of the same
    model, and together the stages hold every parameter of the reference."""
    reference = reference_run(case)["params"]
    seen: set[str] = set()
    for rank in _results(case, request):
        for name, value in rank["params"].items():
            torch.testing.assert_close(value, reference[name], rtol=PARAM_RTOL, atol=PARAM_ATOL)
            seen.add(name)
    assert set(global_parameter_order(model_specs(case.model))) <= seen <= set(reference)


TIES = [PP2_TP2[0], GRID[0], ZERO3[1], ZERO12[2], PP2_SEQUENCE[0]]


@pytest.mark.parametrize("case", TIES, ids=str)
def test_the_tied_embedding_and_head_on_two_stages_stay_equal_under_tensor_parallelism(
    case: Case, request: pytest.FixtureRequest
) -> None:
    params = [rank["params"] for rank in _results(case, request)]
    head = next(p["layers.6.weight"] for p in params if "layers.6.weight" in p)
    embedding = next(p["layers.0.wte.weight"] for p in params if "layers.0.wte.weight" in p)
    assert torch.equal(head, embedding)


# Unclipped cases: the reference reads its norm after clipping, the engine before.
NORMS = [TP2[0], PP2_TP2[2], PP2_TP2[3], GRID[0], ZERO3[2], ZERO12[1], SEQUENCE[1], PP2_SEQUENCE[0]]


@pytest.mark.parametrize("case", NORMS, ids=str)
def test_the_global_gradient_norm_counts_every_shard_once(
    case: Case, request: pytest.FixtureRequest
) -> None:
    reference = reference_run(case)["grad_norms"]
    for rank in _results(case, request):
        assert rank["grad_norms"] == pytest.approx(reference, rel=LOSS_RTOL)


def test_zero2_shards_each_tp_slice_over_its_replicas(request: pytest.FixtureRequest) -> None:
    """bf16 ZeRO-2 at dp 2 × tp 2, per local (tp-shard) Linear element after the steps: the bf16
    weight (2 bytes), and halves of the fp32 gradient, master and SGD momentum (4 / dp each)."""
    expected = {"weights": 2, "gradients": 2, "masters": 2, "moments": 2}
    for rank in _results(ZERO12_LOW_PRECISION[0], request):
        assert rank["zero_bytes"] == pytest.approx(expected, rel=2e-2)


def test_a_non_finite_step_is_skipped_by_every_stage_and_tp_rank_together(
    runs: dict[str, list[dict[str, Any]]],
) -> None:
    assert [rank["skipped"] for rank in runs[str(NAN[0])]] == [[False, True]] * 4


@pytest.mark.parametrize("case", SPLIT + PP2_SEQUENCE[2:], ids=str)
def test_the_split_backward_defers_weight_gradients_under_tensor_parallelism(
    case: Case, runs: dict[str, list[dict[str, Any]]]
) -> None:
    assert any(peak[1] > 0 for rank in runs[str(case)] for peak in rank["pending_w"] if 1 in peak)


def test_q_k_v_biases_a_sliding_window_and_a_tied_llama_head_split_as_the_reference() -> None:
    """The biases sit inside the column-wise q, k, v projections the Llama plan names, so they
    are split with them; the window masks each tp rank's own heads."""
    case = _tp2("llama-biased", 2, 1)
    reference = reference_run(case)
    for rank in run_ranks(run_cases, 4, [case]):
        assert rank[str(case)]["losses"] == pytest.approx(reference["losses"], rel=LOSS_RTOL)
        for name, value in rank[str(case)]["params"].items():
            torch.testing.assert_close(
                value, reference["params"][name], rtol=PARAM_RTOL, atol=PARAM_ATOL
            )
    assert "layers.1.self_attn.q_proj.bias" in reference["params"]


LLAMA_SLICES = {  # llama-tiny: d_model 64, 4 heads, 2 kv heads of 16, MLP 176, vocabulary 256
    "layers.0.embed_tokens.weight": (128, 64),
    "layers.1.self_attn.q_proj.weight": (32, 64),
    "layers.1.self_attn.k_proj.weight": (16, 64),
    "layers.1.self_attn.o_proj.weight": (64, 32),
    "layers.1.mlp.up_proj.weight": (88, 64),
    "layers.1.mlp.down_proj.weight": (64, 88),
    "layers.1.input_layernorm.weight": (64,),
    "layers.6.lm_head.weight": (128, 64),
}


def test_each_tp_rank_holds_its_slice_of_every_split_weight_and_all_of_the_rest(
    runs: dict[str, list[dict[str, Any]]],
) -> None:
    for rank in runs[str(TP2[1])]:
        assert {n: rank["local_shapes"][n] for n in LLAMA_SLICES} == LLAMA_SLICES


@pytest.mark.parametrize("case", PP2_TP2 + GRID + PP2_SEQUENCE, ids=str)
def test_each_tp_rank_sends_its_sequence_shard_between_stages(
    case: Case, runs: dict[str, list[dict[str, Any]]]
) -> None:
    """Activations down and gradients up: (micro-batch, seq_len / tp, d_model), never the
    whole tensor tp times."""
    shard = [(case.micro_batch_size, SEQ_LEN // case.tp, 64)]
    for rank in runs[str(case)]:
        assert rank["sent_shapes"]
        assert all(shapes == shard for shapes in rank["sent_shapes"].values())


def _engine(tp: int, seed: int, model: str = "gpt-tiny", zero: int = 0) -> PipelineEngine:
    """One stage of `model` on `tp` ranks, or under ZeRO on dp 2 × `tp`."""
    specs = model_specs(model)
    return PipelineEngine(
        specs,
        init_mesh(1, 2 if zero else 1, tp, timeout_s=60),
        partition=partition_model(specs, method="uniform", num_stages=1, seq_len=16),
        micro_batches=2,
        seed=seed,
        optimizer=OptimizerSpec(name="adamw", lr=1e-2, impl="per_tensor" if zero else "fused"),
        timeout_s=60,
        options=EngineOptions(zero=zero),
    )


def _full_state(engine: PipelineEngine) -> dict[str, torch.Tensor]:
    """Every parameter and Adam moment as a full tensor, by global name (ZeRO-1/2: the fp32
    masters and state gathered over dp and tp)."""
    assert engine.optimizer is not None
    if engine.sharded is not None:
        masters, states = engine.sharded.full_masters(), engine.sharded.full_state()
    else:
        masters = {id(p): full_tensor(p.detach()) for p in engine.module.parameters()}
        states = {id(p): engine.optimizer.state.get(p, {}) for p in engine.module.parameters()}
    out: dict[str, torch.Tensor] = {}
    for name, param in engine.module.named_parameters():
        out[name] = masters[id(param)].clone()
        for key, value in states[id(param)].items():
            if key != "step":
                out[f"{name}.{key}"] = full_tensor(value).clone()
    return out


def _save_after_a_step(
    rank: int, world_size: int, root: str, tp: int, model: str = "gpt-tiny", zero: int = 0
) -> dict[str, torch.Tensor]:
    engine = _engine(tp, 1, model, zero)
    tokens = torch.randint(0, 256, (4, 17), generator=torch.Generator().manual_seed(0))
    rows = slice(2 * engine.mesh.dp_rank, 2 * engine.mesh.dp_rank + 4 // engine.mesh.dp)
    engine.train_step(tokens[rows, :-1], tokens[rows, 1:])
    save_checkpoint(engine, model_specs(model), root, state=TrainerState(step=1))
    return _full_state(engine)


def _load(
    rank: int, world_size: int, root: str, tp: int, model: str = "gpt-tiny", zero: int = 0
) -> dict[str, torch.Tensor]:
    engine = _engine(tp, 2, model, zero)
    load_checkpoint(engine, model_specs(model), root)
    return _full_state(engine)


def test_a_tp2_checkpoint_loads_at_tp1_and_back_with_its_optimizer_state(
    tmp_path: Path,
) -> None:
    saved = run_ranks(_save_after_a_step, 2, str(tmp_path / "tp2"), 2)[0]
    at_tp1 = run_ranks(_load, 1, str(tmp_path / "tp2"), 1)[0]
    assert at_tp1.keys() == saved.keys()
    assert all(torch.equal(at_tp1[k], saved[k]) for k in saved)
    resaved = run_ranks(_save_after_a_step, 1, str(tmp_path / "tp1"), 1)[0]
    back = run_ranks(_load, 2, str(tmp_path / "tp1"), 2)
    for rank in back:
        assert all(torch.equal(rank[k], resaved[k]) for k in resaved)


def _save_each(
    rank: int, world_size: int, roots: list[tuple[str, int]], model: str
) -> list[dict[str, torch.Tensor]]:
    """`_save_after_a_step` at tp 2 for each (folder, ZeRO level), in one launch."""
    return [_save_after_a_step(rank, world_size, root, 2, model, zero) for root, zero in roots]


def _load_each(
    rank: int, world_size: int, roots: list[tuple[str, int]], tp: int, model: str
) -> list[dict[str, torch.Tensor]]:
    return [_load(rank, world_size, root, tp, model, zero) for root, zero in roots]


def test_tp2_zero_checkpoints_load_at_tp1_without_zero_and_back(tmp_path: Path) -> None:
    """ZeRO-1/2's flat shards of tp shards and FSDP2's shards of tp shards gather to the same
    full tensors under the same names: each loads at tp 1 without ZeRO, and a tp 1 checkpoint
    loads into each (every level in one launch per world)."""
    levels = [(str(tmp_path / f"tp2-zero{zero}"), zero) for zero in (1, 2, 3)]
    saved = run_ranks(_save_each, 4, levels, "gpt-untied")[0]
    plain = [(root, 0) for root, _ in levels]
    loaded = run_ranks(_load_each, 1, plain, 1, "gpt-untied")[0]
    for at_tp1, before in zip(loaded, saved, strict=True):
        assert at_tp1.keys() == before.keys()
        assert all(torch.equal(at_tp1[k], before[k]) for k in before)
    resaved = run_ranks(_save_after_a_step, 1, str(tmp_path / "tp1"), 1, "gpt-untied")[0]
    back = [(str(tmp_path / "tp1"), zero) for zero in (1, 2, 3)]
    for rank in run_ranks(_load_each, 4, back, 2, "gpt-untied"):
        for loaded in rank:
            assert loaded.keys() == resaved.keys()
            assert all(torch.equal(loaded[k], resaved[k]) for k in resaved)
