"""The memory model under ZeRO and tensor parallelism against one rank's real step, run in this
process on torch's fake process group (`engine.memory.fake_world`); and ZeRO-3's
`--zero-reshard auto`, chosen by the memory model."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from engine.config import replace_flat
from engine.memory.estimate import MemoryConfig, estimate_memory
from engine.memory.fake_world import stage_grid
from engine.memory.measure import measure_memory
from engine.memory.reshard import choose_reshard


def _tiny(**changes: object) -> MemoryConfig:
    """llama-tiny, one sequence of 16 tokens per micro-batch, AdamW per tensor (ZeRO-3's
    shards need it), bytes as the CPU allocates them."""
    base: dict[str, object] = {"model": "llama-tiny", "micro_batches": 2, "seq_len": 16}
    base |= {"precision": "bf16", "optimizer_impl": "per_tensor", "device": "cpu"}
    return MemoryConfig.of(**{**base, **changes})  # type: ignore[arg-type]


_RESHARD_ONLY_STAGE_1 = {"zero_reshard": "micro-batch", "zero_reshard_stages": (1,)}


@pytest.mark.parametrize(
    "changes",
    [
        {"dp": 2, "precision": "fp32"},
        {"dp": 2, "zero": 1, "pp": 2, "schedule": "zb_h1", "micro_batches": 4},
        {"dp": 2, "zero": 2, "pp": 2, "micro_batches": 4},
        {"dp": 4, "zero": 2, "micro_batches": 1},
        {"dp": 2, "zero": 3, "precision": "fp32"},
        {"dp": 2, "zero": 3},
        {"dp": 2, "zero": 3, "pp": 2, "schedule": "zb_h1", "micro_batches": 4},
        {"dp": 2, "zero": 3, "zero_reshard": "micro-batch", "recompute": "full"},
        {"dp": 1, "zero": 3, "pp": 2, "micro_batches": 4},
        {"dp": 2, "zero": 3, "pp": 2, "micro_batches": 4, **_RESHARD_ONLY_STAGE_1},
        {"dp": 2, "zero": 3, "pp": 2, "schedule": "interleaved_1f1b", "stages_per_rank": 2}
        | {"micro_batches": 4, "zero_reshard": "micro-batch", "zero_reshard_stages": (2,)},
        {"model": "gpt-tiny", "tp": 2, "precision": "fp32"},
        {"model": "gpt-tiny", "tp": 2},
        {"model": "gpt-tiny", "tp": 2, "sequence_parallel": True, "precision": "fp32"},
        {"tp": 2, "precision": "fp32"},
        {"tp": 2},
        {"tp": 2, "sequence_parallel": True, "precision": "fp32"},
        {"model": "gpt-tiny", "tp": 2, "pp": 2, "precision": "fp32", "micro_batches": 4},
        {"tp": 2, "dp": 2, "zero": 1, "precision": "fp32", "optimizer_impl": "fused"},
        {"tp": 2, "dp": 2, "zero": 3, "precision": "fp32"},
        {"tp": 2, "dp": 2, "zero": 3},
    ],
    ids=[
        "zero0-dp2",
        "zero1-zb_h1",
        "zero2-1f1b",
        "zero2-dp4-one-micro-batch",
        "zero3-fp32",
        "zero3-bf16",
        "zero3-zb_h1",
        "zero3-per-micro-batch-recomputed",
        "zero3-dp1-pp2",
        "zero3-stage-1-per-micro-batch",
        "zero3-one-rank-both-modes",
        "tp2-fp32",
        "tp2-bf16",
        "tp2-sp",
        "tp2-llama",
        "tp2-llama-bf16",
        "tp2-sp-llama",
        "pp2-tp2-head-on-stage-1",
        "tp2-zero1",
        "tp2-zero3",
        "tp2-zero3-bf16",
    ],
)
def test_a_sharded_prediction_equals_one_ranks_real_step_to_the_byte(
    changes: dict[str, object],
) -> None:
    """The bucketed all-reduce, ZeRO-1's flat buffers, ZeRO-2's reduce-scatter, FSDP2's
    gathers and DTensor's collectives run for real against fake peers; every stage's row and
    every rank's peak agree to the byte (under tp: GPT's vocabulary-parallel embedding tied to
    its head, Llama's untied, GPT's untied on its stage at pp 2, whose gradients
    `shard_arriving_gradients` cuts to the shard as they arrive, under ZeRO-3 on FSDP's
    gathered parameters too). The estimate traces the engine's DTensor plans and FSDP2 on a
    fake world, so the loss on sharded logits, the collectives' buffers and FSDP's gathers,
    compute-dtype gradients and their fp32 accumulation allocate as they do in the run."""
    config = _tiny(**changes)
    predicted, measured = estimate_memory(config), measure_memory(config)
    assert predicted.stages == measured.stages
    assert predicted.rank_peaks == measured.rank_peaks


def test_fsdp_does_not_warn_of_views_meshpipes_layers_return() -> None:
    """Their outputs are never modified in place, so FSDP2's warning would only alarm (the
    tp × ZeRO-3 trace returns views from the embedding and the final norm)."""
    from engine.memory.trace_store import forget_traces

    forget_traces()  # the trace must run, not come from the cache
    with warnings.catch_warnings(record=True) as caught:
        estimate_memory(_tiny(tp=2, dp=2, zero=3))
    assert not [w for w in caught if "returned a view tensor" in str(w.message)]


def test_the_fake_world_is_torn_down_and_refuses_a_world_of_another_size() -> None:
    with stage_grid(2, 2) as grid:
        assert grid.dp_mesh is not None and grid.tp_mesh is not None and grid.dp_rank == 0
        refused = pytest.raises(ValueError, match="dp=2 × tp=1 needs a world of 2 ranks")
        with refused, stage_grid(2, 1):
            pass
    assert not dist.is_initialized()


def test_a_zero3_estimate_inside_a_process_group_is_refused_by_name() -> None:
    """The replay shards with FSDP2 on a fake world of its own, which a process already in a
    process group cannot join: it says so and what to do, instead of tracing something else."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from engine.memory.trace_store import forget_traces

    forget_traces()  # traces are cached per stage shape: this one must run
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        with pytest.raises(ValueError, match="estimate before init_process_group"):
            estimate_memory(_tiny(dp=2, zero=3))
    finally:
        dist.destroy_process_group()


# --- --zero-reshard auto ------------------------------------------------------------------------


def _zero3(**changes: object) -> MemoryConfig:
    """Four replicas: the whole fp32 gradients kept for the step outweigh a turn's buffers."""
    return _tiny(dp=4, zero=3, micro_batches=4, **changes)


def test_auto_keeps_the_layers_gathered_without_a_budget_or_when_they_fit() -> None:
    config = _zero3()
    step_peak = estimate_memory(replace_flat(config, zero_reshard="step")).peak
    for budget in (None, step_peak):
        choice = choose_reshard(config, budget)
        assert choice is not None and choice.reshard == "step"


def test_auto_reshards_per_micro_batch_when_the_gathered_step_does_not_fit() -> None:
    config = _zero3()
    step_peak = estimate_memory(replace_flat(config, zero_reshard="step")).peak
    micro = estimate_memory(replace_flat(config, zero_reshard="micro-batch")).peak
    assert micro < step_peak
    choice = choose_reshard(config, step_peak - 1)
    assert choice is not None and choice.reshard == "micro-batch"
    assert "over" in choice.line and "resharded per micro-batch it is" in choice.line


def test_auto_stays_gathered_where_resharding_would_not_lower_the_peak(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where the predicted peak resharded per micro-batch is no lower (a stage of one large
    layer regathers it for every forward and backward), the gathers are not worth it. The
    peaks are stood in for: llama-tiny's are lower per micro-batch at every layout here."""
    peaks = {"step": 2_000_000, "micro-batch": 2_000_000}
    monkeypatch.setattr(
        "engine.memory.reshard.estimate_memory",
        lambda config: SimpleNamespace(
            peak=peaks[config.engine.zero_reshard], rank_peaks=(peaks[config.engine.zero_reshard],)
        ),
    )
    choice = choose_reshard(_tiny(dp=2, zero=3), 1)
    assert choice is not None and choice.reshard == "step" and "no less" in choice.reason


def _pp2(**changes: object) -> MemoryConfig:
    """Two pipeline ranks whose peaks differ (the embedding's stage, the head's stage)."""
    return _zero3(pp=2, **changes)


def test_auto_reshards_only_the_stages_of_the_ranks_over_the_budget() -> None:
    """A rank's peak is its own stages' alone, so a budget between the two ranks' peaks
    gathered for the step reshards the higher rank's stages and lets the other keep the least
    communication; the run's predicted peaks are then the resharded rank's and the kept one's."""
    kept = estimate_memory(_pp2(zero_reshard="step")).rank_peaks
    resharded = estimate_memory(_pp2(zero_reshard="micro-batch")).rank_peaks
    high = max(range(2), key=kept.__getitem__)
    choice = choose_reshard(_pp2(), min(kept))
    assert choice is not None and choice.reshard == "micro-batch" and choice.stages == (high,)
    assert f"on stage {high} (" in choice.line and f"rank {high}'s stages" in choice.line
    mixed = estimate_memory(_pp2(zero_reshard="micro-batch", zero_reshard_stages=choice.stages))
    assert mixed.rank_peaks[high] == resharded[high] < kept[high]
    assert mixed.rank_peaks[1 - high] == kept[1 - high]


def test_auto_reshards_every_stage_when_every_rank_is_over() -> None:
    kept = estimate_memory(_pp2(zero_reshard="step")).rank_peaks
    choice = choose_reshard(_pp2(), min(kept) - 1)
    assert choice is not None and choice.reshard == "micro-batch" and choice.stages is None


def test_auto_under_partition_memory_reshards_every_stage_where_no_kept_split_fits() -> None:
    """--partition memory splits the layers for one reshard mode on every stage, so `auto`
    does not mix them there; where no split fits gathered for the step, it reshards all."""
    kept = estimate_memory(_pp2(zero_reshard="step")).rank_peaks
    budget = f"{min(kept)}B"
    choice = choose_reshard(_pp2(partition="memory", device_memory=budget), min(kept))
    assert choice is not None and choice.reshard == "micro-batch" and choice.stages is None
    assert "--partition memory finds no split within" in choice.reason


def test_auto_stays_gathered_where_a_split_backward_cannot_reshard() -> None:
    config = _zero3(schedule="zb_h1", pp=2)
    choice = choose_reshard(config, 1)
    assert choice is not None and choice.reshard == "step"
    assert "zb_h1's split backward cannot reshard per micro-batch" in choice.reason


def test_auto_chooses_nothing_where_a_mode_is_given_or_zero_is_not_3() -> None:
    assert choose_reshard(_zero3(zero_reshard="micro-batch"), 1) is None
    assert choose_reshard(_tiny(dp=2, zero=2), 1) is None


def test_a_budget_nothing_reads_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="--device-memory 1GB is the budget of --partition"):
        _tiny(dp=2, zero=2, device_memory="1GB")


def test_train_resolves_auto_before_its_ranks_start() -> None:
    """`meshpipe train` asks the memory model with its own --device-memory."""
    from engine.training.config import TrainConfig
    from engine.training.preflight import reshard_choice, with_reshard_choice

    fields: dict[str, object] = {"model": "llama-tiny", "dp": 4, "zero": 3, "seq_len": 16}
    fields |= {"optimizer_impl": "per_tensor", "precision": "bf16", "micro_batches": 4}
    fields |= {"global_batch": 16, "device": "cpu"}
    tight = reshard_choice(TrainConfig.of(**fields, device_memory="2MiB"))
    free = reshard_choice(TrainConfig.of(**fields))
    assert tight is not None and tight.reshard == "micro-batch"
    run = with_reshard_choice(TrainConfig.of(**fields, device_memory="2MiB"), tight)
    assert run.engine.zero_reshard == "micro-batch" and run.partition.device_memory is None
    assert free is not None and free.reshard == "step"
    assert reshard_choice(TrainConfig.of(**fields, zero_reshard="step")) is None


def test_train_runs_the_stages_auto_chose() -> None:
    from engine.memory.reshard import ReshardChoice
    from engine.training.config import TrainConfig
    from engine.training.preflight import with_reshard_choice

    fields: dict[str, object] = {"model": "llama-tiny", "pp": 2, "dp": 2, "zero": 3}
    fields |= {"optimizer_impl": "per_tensor", "device_memory": "2MiB", "device": "cpu"}
    choice = ReshardChoice(reshard="micro-batch", stages=(1,), reason="stage 1 is over")
    run = with_reshard_choice(TrainConfig.of(**fields), choice)
    assert [run.engine.reshard_of(s) for s in (0, 1)] == ["step", "micro-batch"]


def test_partition_memory_refuses_reshard_stages_given_by_hand() -> None:
    """The split is chosen for one mode on every stage, as with --recompute-stages."""
    config = _tiny(pp=2, dp=2, zero=3, zero_reshard="micro-batch", zero_reshard_stages=(0,))
    config = replace_flat(config, partition="memory", device_memory="1GB")
    with pytest.raises(ValueError, match="--partition memory with --zero-reshard-stages"):
        estimate_memory(config)
