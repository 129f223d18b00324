"""The memory model: the tracker, the composed replay, prediction against measurement, the CLI."""

from __future__ import annotations

import argparse
import itertools
import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Shard, distribute_tensor

from engine.cli.memory import add_parsers, run
from engine.comm.grad_sync import BucketedAllReduce
from engine.config import replace_flat
from engine.config.sizes import parse_size
from engine.memory.estimate import MemoryConfig, estimate_memory, resolve, stage_trace
from engine.memory.fake_world import stage_grid
from engine.memory.measure import check_measurable, measure_memory
from engine.memory.replay import build_stage, local_edges, stage_actions
from engine.memory.sharding import sharded_states
from engine.memory.states import (
    ParamInfo,
    StateLayout,
    deepspeed_zero2_model_states,
    dp_buckets,
    megatron_activations,
    param_info,
    stage_params,
)
from engine.memory.suggest import held_with_gradients, memory_balanced, states_floor, suggest
from engine.memory.tracker import MemoryTracker, fake_device
from engine.schedule.generators import SCHEDULES, VIRTUAL_SCHEDULES, make_schedule
from engine.schedule.simulate import simulate
from engine.schedule.v_schedules import V_SCHEDULES
from models import layer_specs

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parents[2]


def _tiny(**changes: object) -> MemoryConfig:
    """llama-tiny at pp 2, micro-batches of 2 sequences (kept when dp or their count change)."""
    base: dict[str, object] = {"model": "llama-tiny", "pp": 2, "micro_batches": 4}
    base |= {"micro_batch_size": 2, "seq_len": 32, "device": "cpu"}
    return MemoryConfig.of(**{**base, **changes})  # type: ignore[arg-type]


# --- sizes as people write them -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("80GB", 80 * 10**9),
        ("80GiB", 80 * 2**30),
        ("8e10", 8 * 10**10),
        ("85899345920", 85899345920),
        ("1.5 TiB", 3 * 2**39),
        ("512mb", 512 * 10**6),
    ],
)
def test_sizes_read_decimal_and_binary_units(text: str, size: int) -> None:
    assert parse_size(text) == size


def test_an_unreadable_size_names_the_value_and_the_forms() -> None:
    with pytest.raises(ValueError, match=r"'eighty'.*80GB = 80·10\^9 bytes, 80GiB = 80·2\^30"):
        parse_size("eighty")


def test_a_size_beyond_a_floats_range_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"'1e400' is beyond a float's range: give a finite"):
        parse_size("1e400")


def test_a_bare_giga_is_ambiguous() -> None:
    with pytest.raises(ValueError, match="'80G' is ambiguous: write 80GB .* or 80GiB"):
        parse_size("80G")


# --- the tracker ----------------------------------------------------------------------------------


def test_tracker_counts_a_storage_once_from_its_op_until_it_is_freed() -> None:
    with MemoryTracker() as tracker:
        x = torch.empty(1000)
        view = x[10:20].view(2, 5)
        x.add_(1.0)
        assert tracker.live == 4000
        del x
        assert tracker.live == 4000  # the view keeps the storage alive
        del view
    assert (tracker.live, tracker.peak) == (0, 4000)


def test_tracker_counts_a_dtensors_local_shard_not_its_global_size() -> None:
    """A DTensor's own storage is as large as the whole tensor and allocates nothing; what a
    rank holds is its shard."""
    with stage_grid(1, 2) as grid:
        assert grid.tp_mesh is not None
        whole = distribute_tensor(torch.ones(256, 64), grid.tp_mesh, [Shard(0)])
        with MemoryTracker() as tracker:
            doubled = whole * 2
        assert tracker.live == 128 * 64 * 4
        del doubled
        assert tracker.live == 0


def test_tracker_ignores_tensors_made_before_it() -> None:
    weight = torch.ones(256)
    with MemoryTracker() as tracker:
        weight.mul_(2.0)
        doubled = weight * 2.0
    assert tracker.live == doubled.numel() * 4


def test_tracker_rounds_each_storage_up_to_cuda_blocks() -> None:
    with MemoryTracker(block=512) as tracker:
        tensors = [torch.empty(1), torch.empty(129)]
    assert tracker.live == 512 + 1024 and len(tensors) == 2


@pytest.mark.parametrize("cuda", [True, False])
def test_a_fake_half_precision_layer_norm_keeps_its_statistics_in_fp32(cuda: bool) -> None:
    """As the device kernels do (the CPU one with the fp32 weight autocast leaves), where the
    meta kernel keeps them in the input's dtype: the tracker counts what the device makes."""
    rows, width = 64, 32
    with fake_device(cuda=cuda):
        x = torch.empty(rows, width, dtype=torch.bfloat16)
        weight, bias = torch.ones(width), torch.zeros(width)
        with MemoryTracker() as tracker:
            out, mean, rstd = torch.ops.aten.native_layer_norm(x, [width], weight, bias, 1e-5)
    assert mean.dtype == rstd.dtype == torch.float32
    assert tracker.live == rows * width * 2 + 2 * rows * 4
    del out


def test_the_layer_norm_statistics_are_left_as_made_outside_a_fake_device() -> None:
    x = torch.ones(4, 8, dtype=torch.bfloat16)
    weight, bias = torch.ones(8, dtype=torch.bfloat16), torch.zeros(8, dtype=torch.bfloat16)
    with MemoryTracker():
        _, mean, _ = torch.ops.aten.native_layer_norm(x, [8], weight, bias, 1e-5)
    assert mean.dtype == torch.ops.aten.native_layer_norm(x, [8], weight, bias, 1e-5)[1].dtype


def test_cuda_model_keeps_flash_statistics_instead_of_the_attention_matrix() -> None:
    b, h, t, d = 1, 4, 256, 16
    with fake_device(cuda=True):
        q, k, v = (torch.empty(b, h, t, d, dtype=torch.bfloat16, requires_grad=True) for _ in "qkv")
        with MemoryTracker(block=512) as tracker:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    kept = b * h * t * d * 2 + b * h * t * 4 + 2 * 512  # output, fp32 log-sum-exp, RNG state
    assert tracker.live == kept and out.shape == q.shape


# --- the replay ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "changes",
    [
        {"schedule": "zb_h1"},
        {"schedule": "zb_drain", "micro_batches": 6, "pp": 3},
        {"recompute": "every:1"},
        {"schedule": "interleaved_1f1b", "stages_per_rank": 2, "device": "cuda"},
        {"model": "gpt-tiny", "pp": 3, "dp": 2, "precision": "fp16"},
    ],
    ids=["zb-h1", "zb-drain", "recompute", "interleaved-cuda", "gpt-dp-fp16"],
)
def test_composing_one_micro_batch_equals_replaying_all_of_them(changes: dict[str, object]) -> None:
    config = _tiny(**changes)
    assert estimate_memory(config) == replace(measure_memory(config, fake=True), source="predicted")


@pytest.mark.parametrize("model", ["gpt-tiny", "llama-tiny"])
@pytest.mark.parametrize(
    ("schedule", "impl"), [("gpipe", "fused"), ("1f1b", "per_tensor"), ("zb_drain", "fused")]
)
def test_prediction_equals_a_real_run_on_cpu_to_the_byte(
    model: str, schedule: str, impl: str
) -> None:
    config = _tiny(model=model, schedule=schedule, optimizer_impl=impl)
    predicted, measured = estimate_memory(config), measure_memory(config)
    assert predicted.stages == measured.stages
    assert predicted.rank_peaks == measured.rank_peaks


def test_the_dp_reduction_writes_its_sums_back_without_allocating() -> None:
    """`BucketedAllReduce.finish` hands each parameter a view of its bucket's flat sum, and
    the write-back allocates nothing: templates of the gradients' shapes once held a third
    copy of them, the step's peak where the reduction is (gpt-tiny, pp 2 × dp 2, recomputed
    per layer: 1,496,712 → 1,197,448 B on stage 0, the prediction equal to the run)."""
    with stage_grid(2, 1) as grid:
        layer = torch.nn.Linear(64, 64)
        for param in layer.parameters():
            param.grad = torch.ones_like(param)
        reduction = BucketedAllReduce(list(layer.parameters()), grid.dp_group)
        with MemoryTracker() as tracker:
            reduction.start()
            write_back = tracker.measure(reduction.finish)
    assert write_back.peak == 0
    assert all(p.grad is not None and p.grad.shape == p.shape for p in layer.parameters())


def test_the_dp_reduction_replaces_each_buckets_gradients_with_its_flat_copy() -> None:
    """`BucketedAllReduce.start` makes each bucket's gradients views of its flat copy as it
    makes it, so posting four buckets rises by one bucket and leaves only the counts behind
    (16,400 and 16 B here), where flattening them beside the gradients held a second copy of
    all of them until the reduction ended (65,552 and 65,552 B)."""
    with stage_grid(2, 1) as grid:
        layers = torch.nn.Sequential(*(torch.nn.Linear(64, 64, bias=False) for _ in range(4)))
        bucket = 64 * 64 * 4
        reduction = BucketedAllReduce(list(layers.parameters()), grid.dp_group, bucket_bytes=bucket)
        with MemoryTracker() as tracker:
            for param in layers.parameters():
                param.grad = torch.ones_like(param)
            posting = tracker.measure(reduction.start)
            reduction.finish()
    counts = 4 * 4  # each bucket's one count of replicas (fp32), which stays
    assert posting.peak == bucket + counts and posting.net == counts
    assert all(torch.equal(p.grad, torch.ones_like(p)) for p in layers.parameters())


def test_a_dp_step_whose_reduction_is_its_peak_is_predicted_to_the_byte() -> None:
    config = _tiny(model="gpt-tiny", dp=2, recompute="every:1")
    predicted, measured = estimate_memory(config), measure_memory(config)
    assert predicted.stages == measured.stages
    assert predicted.rank_peaks == measured.rank_peaks


@pytest.mark.parametrize("schedule", ["zb_v", "v_min"])
def test_v_placed_prediction_equals_a_real_run_on_cpu_to_the_byte(schedule: str) -> None:
    config = _tiny(schedule=schedule, stages_per_rank=2)
    predicted, measured = estimate_memory(config), measure_memory(config)
    assert predicted.stages == measured.stages
    assert predicted.rank_peaks == measured.rank_peaks


def test_the_v_hand_off_between_stages_of_one_rank_stays_in_memory() -> None:
    """Stages 1 and 2 of a V on two ranks share rank 1: stage 2's input arrives in memory, so
    it sends no gradient back to hold until the step's end (its output sent on to stage 3 is
    released when that gradient arrives), where the loop placement holds one per micro-batch."""
    v = resolve(_tiny(schedule="zb_v", stages_per_rank=2)).schedule
    assert [local_edges(v, s) for s in range(4)] == [
        (False, False),
        (False, True),
        (True, False),
        (False, False),
    ]
    held = {
        name: stage_trace(config, resolve(config), 2).held_per_micro_batch
        for name, config in (
            ("v", _tiny(schedule="zb_v", stages_per_rank=2)),
            ("loop", _tiny(schedule="looped_bfs", stages_per_rank=2)),
        )
    }
    assert held["v"] == 0 < held["loop"]


@pytest.mark.parametrize("schedule", ["gpipe", "zb_drain"])
def test_one_micro_batch_per_step_is_estimated_like_a_real_run(schedule: str) -> None:
    """The trace runs two micro-batches per backward style whatever the step's count."""
    config = _tiny(schedule=schedule, micro_batches=1)
    predicted, measured = estimate_memory(config), measure_memory(config)
    assert predicted.stages == measured.stages


def test_recomputed_stage_keeps_only_its_input_and_sent_output() -> None:
    config = _tiny(pp=3, recompute="full")
    boundary = (
        config.micro_batch_size * config.batch.seq_len * 64 * 2
    )  # bf16 activations, d_model 64
    assert estimate_memory(config).stages[1].kept_per_micro_batch == 2 * boundary


def test_autocast_keeps_one_bf16_copy_of_every_matmul_weight_per_step() -> None:
    config = _tiny(pp=3)
    layout = resolve(config)
    linear = sum(
        p.numel()
        for spec in layout.stage_specs(1)
        for m in spec.build("meta").modules()
        if isinstance(m, torch.nn.Linear)
        for p in m.parameters()
    )
    bf16, fp32 = estimate_memory(config), estimate_memory(replace_flat(config, precision="fp32"))
    assert bf16.stages[1].weight_copies == 2 * linear
    assert fp32.stages[1].weight_copies == 0


def test_more_micro_batches_in_flight_add_their_stashes_but_no_weight_copies() -> None:
    four, eight = (estimate_memory(_tiny(pp=3, schedule="gpipe", micro_batches=m)) for m in (4, 8))
    middle_four, middle_eight = four.stages[1], eight.stages[1]
    assert middle_eight.weight_copies == middle_four.weight_copies > 0
    assert middle_eight.step_peak - middle_four.step_peak == 4 * middle_four.kept_per_micro_batch


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_every_registered_schedule_is_replayed_like_all_its_micro_batches(schedule: str) -> None:
    virtual = schedule in VIRTUAL_SCHEDULES or schedule in V_SCHEDULES
    config = _tiny(schedule=schedule, stages_per_rank=2 if virtual else 1)
    assert estimate_memory(config) == replace(measure_memory(config, fake=True), source="predicted")


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb_h2", "zb_drain"])
def test_in_flight_micro_batches_are_the_simulators(schedule: str) -> None:
    config = _tiny(pp=3, schedule=schedule)
    expected = simulate(resolve(config).schedule).activation_peak  # until B or W
    assert tuple(s.in_flight for s in estimate_memory(config).stages) == expected


def test_model_states_are_16_bytes_per_parameter_whatever_the_precision() -> None:
    config = _tiny(precision="bf16")
    layout = resolve(config)
    for stage in estimate_memory(config).stages:
        tensors = len(layout.params([stage.stage]))
        assert (stage.weights, stage.gradients) == (4 * stage.parameters, 4 * stage.parameters)
        assert stage.optimizer == 8 * stage.parameters + 4 * tensors  # and a step counter each


def test_per_tensor_adamw_keeps_its_step_counters_off_the_gpu() -> None:
    fused, per_tensor = (
        estimate_memory(_tiny(device="cuda", optimizer_impl=impl)).stages[0].optimizer
        for impl in ("fused", "per_tensor")
    )
    assert fused - per_tensor == 512 * len(resolve(_tiny()).params([0]))


def test_cuda_model_allocates_whole_512_byte_blocks() -> None:
    stages = estimate_memory(_tiny(device="cuda")).stages
    assert all(s.kept_per_micro_batch % 512 == 0 and s.step_peak % 512 == 0 for s in stages)


def _bytes_per_parameter(zero: int) -> tuple[float, float, float, float]:
    params = stage_params(layer_specs("llama3-70b")[1:3])
    total = sum(p.numel for p in params)
    states = sharded_states(params, StateLayout(dp=8, zero=zero), precision="bf16")
    held = (states.weights, states.gradients, states.optimizer, states.gathered)
    return tuple(round(b / total, 3) for b in held)  # type: ignore[return-value]


def test_zero_1_keeps_megatrons_distributed_optimizer_bytes_per_parameter() -> None:
    """bf16 weights, fp32 gradient buffer, 1/dp of fp32 masters and two moments: 7.5 at dp 8."""
    assert _bytes_per_parameter(1) == (2.0, 4.0, 1.5, 0.0)


def test_zero_3_keeps_16_over_dp_bytes_per_parameter_between_steps() -> None:
    """fp32 shards of weights and moments (2 at dp 8); the step gathers bf16 layers and
    accumulates their fp32 gradients unsharded."""
    assert _bytes_per_parameter(3) == (0.5, 4.0, 1.0, 2.0)


def test_zero_levels_order_the_llama_70b_peaks() -> None:
    base = {"model": "llama-70b", "pp": 8, "dp": 8, "micro_batches": 16, "seq_len": 4096}
    peaks = [
        estimate_memory(MemoryConfig.of(**base, recompute="full", zero=z)).peak for z in (0, 1)
    ]
    assert peaks[1] < peaks[0] * 0.75


def test_dp_buckets_close_once_they_reach_25_mib() -> None:
    mib = 2**20 // 4
    params = [ParamInfo(n * mib, True) for n in (20, 10, 30, 1)]
    assert [[p.numel // mib for p in b] for b in dp_buckets(params)] == [[20, 10], [30], [1]]


def test_estimating_llama_70b_allocates_no_model_memory() -> None:
    script = textwrap.dedent(
        r"""
        import re, warnings
        warnings.simplefilter("ignore")
        from engine.memory.estimate import MemoryConfig, estimate_memory
        config = MemoryConfig.of(model="llama-70b", pp=40, micro_batches=40, seq_len=4096)
        assert estimate_memory(config).peak > 20 * 2**30
        status = open("/proc/self/status").read()
        print(re.search(r"VmHWM:\s+(\d+) kB", status).group(1))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, check=True
    )
    # KiB: under 1 GiB for ~1 TB of states. VmHWM is this process's own peak: getrusage's
    # ru_maxrss would count the pytest process it was started from, after exec too.
    assert int(done.stdout.split()[-1]) < 1024 * 1024


# --- planning -----------------------------------------------------------------------------------


def test_memory_balanced_minimises_the_largest_weighted_stage() -> None:
    states, kept, flight = [5, 1, 1, 1, 1, 5], [1, 4, 4, 4, 4, 1], [3, 2, 1]
    partition = memory_balanced(states, kept, flight)

    def worst(bounds: tuple[int, ...]) -> int:
        stages = zip(flight, itertools.pairwise(bounds), strict=True)
        return max(sum(states[a:b]) + w * sum(kept[a:b]) for w, (a, b) in stages)

    every = [(0, *cut, 6) for cut in itertools.combinations(range(1, 6), 2)]
    assert worst(partition.boundaries) == min(map(worst, every))


def test_suggestions_are_estimated_and_one_fits() -> None:
    config = _tiny(micro_batches=8)
    report = estimate_memory(config)
    budget = report.peak - 64 * 1024
    found = suggest(config, report, budget)
    assert any(s.report.peak <= budget for s in found)
    assert all(s.report == estimate_memory(s.report.config) for s in found)


def test_more_stages_suggests_the_fewest_that_fits() -> None:
    # gpt-tiny's 3 GPipe stages sum to more per layer than their estimate: no skipping on that.
    config = MemoryConfig.of(model="gpt-tiny", pp=2, schedule="gpipe")
    budget = 5_000_000
    found = suggest(config, estimate_memory(config), budget)
    more = [s for s in found if s.change.startswith("--pp ")]
    assert [s.change for s in more] == ["--pp 3 --partition boundaries:0,2,4,7"]
    assert more[0].report.peak <= budget


def _devices(config: MemoryConfig) -> int:
    return config.parallel.pp * config.parallel.dp * config.parallel.tp


@pytest.mark.parametrize(("zero", "offered"), [(0, "--tp 2"), (1, "--pp 4")])
def test_same_devices_trade_replicas_for_stages_or_tp(zero: int, offered: str) -> None:
    """Half the replicas buy twice the stages (or, without ZeRO, the tp width) on the same
    devices, the global batch and micro-batch size unchanged."""
    config = _tiny(dp=2, zero=zero, micro_batches=8)
    report = estimate_memory(config)
    found = [s for s in suggest(config, report, report.peak - 1) if s.change.startswith(offered)]
    assert len(found) == 1
    other = found[0].report.config
    assert _devices(other) == _devices(config)
    assert other.batch.global_batch == config.batch.global_batch
    assert other.micro_batch_size == config.micro_batch_size
    assert "the same 4 ranks" in found[0].note


def test_zero_with_tp_is_offered_on_the_same_devices() -> None:
    config = _tiny(dp=2, zero=1, micro_batches=8)
    report = estimate_memory(config)
    found = [s for s in suggest(config, report, report.peak - 1) if s.change.startswith("--tp 2")]
    assert len(found) == 1
    other = found[0].report.config
    assert (other.parallel.tp, other.parallel.dp, other.engine.zero) == (2, 1, 1)


@pytest.mark.parametrize("zero", [1, 2])
def test_zero_1_and_2_shard_each_tensor_parallel_slice_over_the_replicas(zero: int) -> None:
    """`memory --zero 1|2 --tp 2`: a rank's states are ZeRO's flat buffers (over dp) of its tp
    shard of the stage, less than half the tp 1 layout's past the replicated norms."""
    one, two = (_tiny(dp=2, zero=zero, tp=tp, precision="bf16") for tp in (1, 2))
    layout = resolve(two)
    assert layout.states.tp == 2 and layout.states.zero == zero
    expected = sharded_states(layout.params([0]), layout.states, precision="bf16")
    whole, split = (estimate_memory(c).stages[0] for c in (one, two))
    held = (split.weights, split.gradients, split.optimizer)
    assert held == (expected.weights, expected.gradients, expected.optimizer)
    assert split.weights + split.optimizer < (whole.weights + whole.optimizer) * 0.55


def test_zero_3_is_offered_with_what_train_needs() -> None:
    config = _tiny(dp=2, micro_batches=8)
    report = estimate_memory(config)
    zero3 = [s for s in suggest(config, report, report.peak - 1) if s.change == "--zero 3"]
    assert zero3 and "--optimizer-impl per_tensor" in zero3[0].note
    assert zero3[0].report.config.engine.zero == 3


def test_zero3_resharded_per_micro_batch_holds_gradient_shards_and_one_layer() -> None:
    """Per micro-batch, ZeRO-3 keeps fp32 gradient shards (1/dp) instead of the stage's whole
    fp32 gradients, and gathers a layer at a time instead of every layer, with one layer's
    reduce-scatter input in flight: at llama-7b's size and dp 8 the step's peak above the
    states is less than half; the kept states do not change."""
    base: dict[str, object] = {"model": "llama-7b", "pp": 4, "dp": 8, "zero": 3}
    base |= {"micro_batches": 8, "seq_len": 512}
    step = estimate_memory(MemoryConfig.of(**base))  # type: ignore[arg-type]
    micro = estimate_memory(MemoryConfig.of(**base, zero_reshard="micro-batch"))  # type: ignore[arg-type]
    for kept, resharded in zip(step.stages, micro.stages, strict=True):
        assert 8 * resharded.gradients == pytest.approx(kept.gradients, rel=1e-3)
        assert (resharded.weights, resharded.optimizer) == (kept.weights, kept.optimizer)
        assert resharded.step_peak < kept.step_peak / 2


def test_memory_balanced_with_gradients_minimises_the_largest_modelled_stage() -> None:
    states, grads, kept = [5, 1, 2, 1, 3, 5], [2, 1, 1, 1, 1, 2], [1, 4, 3, 4, 2, 1]
    flight, after = [3, 2, 1], [2, 2, 1]
    partition = memory_balanced(states, kept, flight, grads=grads, after=after)

    def worst(bounds: tuple[int, ...]) -> int:
        stages = zip(flight, after, itertools.pairwise(bounds), strict=True)
        return max(
            sum(states[a:b]) + max(w * sum(kept[a:b]), sum(grads[a:b]) + h * sum(kept[a:b]))
            for w, h, (a, b) in stages
        )

    every = [(0, *cut, 6) for cut in itertools.combinations(range(1, 6), 2)]
    assert worst(partition.boundaries) == min(map(worst, every))


@pytest.mark.parametrize(
    ("micro_batches", "held"), [(4, [3, 3, 2, 1]), (8, [4, 3, 2, 1]), (2, [1, 1, 1, 1])]
)
def test_stashes_held_once_gradients_exist_follow_the_1f1b_rows(
    micro_batches: int, held: list[int]
) -> None:
    """With m <= P, 1F1B's first stages run every forward before their first B: the
    gradients that B allocates never meet all of their stashes."""
    schedule = make_schedule("1f1b", num_ranks=4, micro_batches=micro_batches)
    assert [held_with_gradients(stage_actions(schedule, s)) for s in range(4)] == held


@pytest.mark.parametrize(
    "config",
    [
        MemoryConfig.of(model="gpt-tiny", pp=3, micro_batches=2, seq_len=64),
        MemoryConfig.of(model="gpt-tiny", pp=3, micro_batches=2, seq_len=64, precision="fp32"),
        MemoryConfig.of(
            model="gpt-tiny", pp=3, micro_batches=2, seq_len=64, schedule="zb_h1", precision="fp32"
        ),
        MemoryConfig.of(model="llama-tiny", pp=3, micro_batches=2, seq_len=16, schedule="zb_h1"),
    ],
    ids=["1f1b-bf16", "1f1b-fp32", "zb-h1-gpt", "zb-h1-llama"],
)
def test_no_suggestion_is_worse_than_the_layout(config: MemoryConfig) -> None:
    """Layouts where the per-layer sums' memory-balanced boundaries (old or new model) come
    out above the layout's own peak (as llama-70b's did at pp 8): such a candidate is dropped."""
    report = estimate_memory(config)
    found = suggest(config, report, report.peak - 1)
    assert found
    assert all(s.report.peak < report.peak for s in found)


@pytest.mark.parametrize(
    "changes",
    [{}, {"schedule": "gpipe"}, {"schedule": "zb_h1"}, {"dp": 2, "zero": 1}, {"dp": 2}],
)
def test_states_floor_is_a_lower_bound_of_the_estimate(changes: dict[str, object]) -> None:
    """Weights, gradients and optimizer states: `_more_stages` skips sizes on it unestimated."""
    config = _tiny(pp=3, **changes)
    assert states_floor(config) <= estimate_memory(config).peak
    assert states_floor(config) > max(
        s.weights + s.optimizer for s in estimate_memory(config).stages
    )


@pytest.mark.parametrize("model", ["gpt-tiny", "llama-tiny"])
def test_stage_params_equal_a_built_stage_with_its_ties(model: str) -> None:
    specs = layer_specs(model)
    for layers in (specs, specs[:1], specs[-1:], specs[1:3]):
        assert stage_params(layers) == param_info(build_stage(layers))


@pytest.mark.parametrize("schedule", ["gpipe", "zb_drain"])
def test_a_schedule_holding_more_in_flight_is_offered_1f1b(schedule: str) -> None:
    config = _tiny(schedule=schedule, micro_batches=8)
    report = estimate_memory(config)
    found = {s.change: s for s in suggest(config, report, report.peak - 1)}
    assert found["--schedule 1f1b"].report.peak < report.peak
    assert found["--schedule 1f1b"].report.stages[0].in_flight < report.stages[0].in_flight


def test_1f1b_is_not_offered_itself() -> None:
    config = _tiny(schedule="1f1b", micro_batches=8)
    report = estimate_memory(config)
    assert not any("--schedule 1f1b" in s.change for s in suggest(config, report, report.peak - 1))


def test_reference_formulas_are_their_sources() -> None:
    assert deepspeed_zero2_model_states(10**9, 8) == 4 * 10**9 + 2 * 10**9
    s, b, h, a = 4096, 1, 8192, 64
    expected = s * b * h * (34 + 5 * a * s // h)
    assert (
        megatron_activations(
            seq_len=s, micro_batch_size=b, hidden=h, heads=a, layers=1, flash=False
        )
        == expected
    )


# --- the command --------------------------------------------------------------------------------


def _memory(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    parser = argparse.ArgumentParser(prog="meshpipe")
    add_parsers(parser.add_subparsers(dest="command"))
    code = run(parser.parse_args(["memory", *argv]), argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_memory_command_prints_a_row_per_stage_and_the_fit(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, _ = _memory(capsys, "--model", "gpt-tiny", "--pp", "2", "--device-memory", "1GiB")
    assert code == 0
    assert "[0, 3)" in out and "[3, 7)" in out and "fits: peak" in out


def test_measure_flag_reports_prediction_equal_to_measurement(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, _ = _memory(
        capsys, "--model", "gpt-tiny", "--pp", "2", "--device", "cpu", "--measure"
    )
    assert code == 0 and "predicted == measured (bytes)" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "llama-8b"], "unknown model 'llama-8b': choose one of gpt-tiny"),
        (["--pp", "8"], "cannot split gpt-tiny's 7 layers into 8 stages"),
        (["--micro-batches", "0"], "micro_batches=0 must be at least 1"),
        (["--global-batch", "10", "--micro-batches", "4"], "global batch 10 does not split"),
        (["--dp", "0", "--global-batch", "8"], "dp=0 must be at least 1"),
        (["--micro-batches", "0", "--global-batch", "8"], "micro_batches=0 must be at least 1"),
        (["--global-batch", "0"], "global_batch=0 must be at least 1"),
        (["--schedule", "pipedream"], "unknown schedule 'pipedream': choose one of gpipe"),
        (["--model", "llama-70b", "--device", "cpu", "--measure"], "builds llama-70b for real"),
        (["--device", "cuda", "--measure"], "--measure --device cuda needs a GPU"),
    ],
)
def test_bad_input_exits_2_with_the_reason(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    code, _, err = _memory(capsys, *argv)
    assert code == 2 and message in err


def test_a_device_memory_beyond_a_floats_range_is_a_usage_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        _memory(capsys, "--device-memory", "1e400")
    assert exit_info.value.code == 2 and "'1e400' is beyond" in capsys.readouterr().err


def test_an_unreadable_device_memory_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        _memory(capsys, "--device-memory", "eighty")
    assert (
        exit_info.value.code == 2 and "cannot read memory size 'eighty'" in capsys.readouterr().err
    )


def test_every_schedule_stage_is_replayed_in_its_rank_order() -> None:
    layout = resolve(_tiny(schedule="1f1b"))
    assert [str(a) for a in stage_actions(layout.schedule, 0)] == [
        "0F0",
        "0F1",
        "0B0",
        "0F2",
        "0B1",
        "0F3",
        "0B2",
        "0B3",
    ]


def _fitting(**changes: object) -> MemoryConfig:
    base: dict[str, object] = {
        "model": "llama-1b",
        "pp": 4,
        "micro_batches": 8,
        "seq_len": 2048,
        "micro_batch_size": 2,
    }
    return MemoryConfig.of(**{**base, **changes})  # type: ignore[arg-type]


def test_memory_partition_fits_a_budget_the_balanced_split_exceeds() -> None:
    budget = 13 * 2**30
    assert estimate_memory(_fitting()).peak > budget
    report = estimate_memory(_fitting(partition="memory", device_memory="13GiB"))
    assert report.peak <= budget
    assert report.partition != estimate_memory(_fitting()).partition


def test_memory_partition_is_corrected_by_the_replay_for_split_backwards() -> None:
    budget = 13.75 * 2**30
    report = estimate_memory(
        _fitting(schedule="zb_h1", partition="memory", device_memory="13.75GiB")
    )
    assert report.peak <= budget < estimate_memory(_fitting(schedule="zb_h1")).peak


def test_memory_partition_keeps_the_fastest_split_when_it_fits() -> None:
    report = estimate_memory(_fitting(partition="memory", device_memory="80GB"))
    assert report.partition == estimate_memory(_fitting()).partition


def test_memory_partition_that_nothing_fits_says_what_the_leanest_split_needs() -> None:
    with pytest.raises(ValueError, match=r"no split fits 4.0 GiB per device.*peaks at 1\d.\d GiB"):
        estimate_memory(_fitting(partition="memory", device_memory="4GiB"))


def test_memory_partition_needs_a_device_memory() -> None:
    with pytest.raises(ValueError, match="--partition memory .* give --device-memory"):
        _fitting(partition="memory")


def test_a_device_memory_without_the_memory_partition_is_refused() -> None:
    with pytest.raises(ValueError, match="--device-memory 80GB is the budget of --partition"):
        _fitting(device_memory="80GB")


def test_memory_partition_budgets_one_stage_per_device() -> None:
    with pytest.raises(ValueError, match="stages per rank: it budgets one stage per device"):
        estimate_memory(
            _fitting(
                schedule="interleaved_1f1b",
                stages_per_rank=2,
                partition="memory",
                device_memory="80GB",
            )
        )


def test_a_tensor_parallel_rank_holds_its_share_of_every_split_weight() -> None:
    specs = layer_specs("llama-tiny")
    whole = sum(p.numel for p in stage_params(specs))
    norms = sum(p.numel for p in stage_params(specs) if not p.decay)
    assert sum(p.numel for p in stage_params(specs, 2)) == (whole - norms) // 2 + norms


def test_tensor_parallelism_divides_a_stage_states_and_weight_copies() -> None:
    base = {"model": "llama-tiny", "pp": 2, "precision": "bf16", "device": "cpu"}
    one, two = (estimate_memory(MemoryConfig.of(**base, tp=tp)).stages[0] for tp in (1, 2))
    assert two.parameters < one.parameters and two.weight_copies * 2 == one.weight_copies


def test_measuring_a_model_too_large_to_build_here_is_refused_by_name() -> None:
    """Tensor parallelism and ZeRO are measured as one rank (tests/unit/test_memory_sharded.py);
    what one process cannot build is refused before anything is allocated."""
    config = MemoryConfig.of(model="llama-7b", pp=2, tp=2, device="cpu")
    with pytest.raises(ValueError, match="--measure builds llama-7b for real here"):
        check_measurable(config)


def test_a_generators_own_schedule_is_not_validated_again_and_a_file_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The generators' schedules are valid by their tests (the planner replays hundreds); a
    schedule file, or a generator's under another placement, is checked as it is read."""
    import engine.memory.estimate
    from engine.schedule import make_schedule
    from engine.schedule.text import save_schedule

    checked: list[str] = []
    monkeypatch.setattr(engine.memory.estimate, "validate", lambda s: checked.append(s.name))
    resolve.cache_clear()
    resolve(_tiny(schedule="1f1b", micro_batches=6))
    assert checked == []
    path = tmp_path / "s.csv"
    save_schedule(make_schedule("1f1b", num_ranks=2, micro_batches=6), path)
    resolve(_tiny(schedule=str(path), micro_batches=6))
    resolve(_tiny(schedule="looped_bfs", stages_per_rank=2, placement="v", micro_batches=6))
    assert len(checked) == 2
