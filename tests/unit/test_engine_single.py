"""PipelineEngine in one process (pp = dp = 1) is the reference step, and checks its input."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from engine.comm.mesh import init_mesh
from engine.config import EngineOptions
from engine.runtime.engine import PipelineEngine
from engine.runtime.optim import build_optimizer
from engine.runtime.reference import reference_step
from engine.schedule.generators import one_f_one_b
from engine.schedule.schedule import Schedule
from models import build_layers, layer_specs
from partitioners import Partition

torch.set_num_threads(1)


class _WeightCasts(TorchDispatchMode):
    """Counts casts of parameters (autocast's low-precision weight copies)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func is torch.ops.aten._to_copy.default and isinstance(args[0], nn.Parameter):
            self.count += 1
        return func(*args, **(kwargs or {}))


def _engine(
    schedule: str | Schedule,
    micro_batches: int,
    precision: str = "fp32",
    recompute: str = "none",
    model: str = "llama-tiny",
) -> PipelineEngine:
    specs = layer_specs(model)
    return PipelineEngine(
        specs,
        init_mesh(1, 1),
        partition=Partition(boundaries=(0, len(specs))),
        micro_batches=micro_batches,
        schedule=schedule,
        seed=3,
        optimizer=lambda m: build_optimizer(m, lr=1e-2),
        options=EngineOptions(precision=precision, recompute=recompute),
    )


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_single_rank_engine_equals_the_reference_bit_for_bit(schedule: str) -> None:
    engine = _engine(schedule, 4)
    model = build_layers(layer_specs("llama-tiny"), seed=3)
    optimizer = build_optimizer(model, lr=1e-2)
    tokens = torch.randint(0, 256, (8, 17), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        stats = engine.train_step(tokens[:, :-1], tokens[:, 1:])
        loss = reference_step(model, optimizer, tokens[:, :-1], tokens[:, 1:], micro_batches=4)
        assert stats.loss == loss
    for (name, a), b in zip(engine.module.named_parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b), name


@pytest.mark.parametrize(
    ("model_name", "schedule", "recompute"),
    [
        ("llama-tiny", "gpipe", "none"),
        ("llama-tiny", "1f1b", "none"),
        ("llama-tiny", "1f1b", "full"),
        ("llama-tiny", "zb_h1", "none"),
        ("gpt-tiny", "1f1b", "none"),
    ],
)
def test_bf16_engine_sharing_weight_copies_equals_the_reference_bit_for_bit(
    model_name: str, schedule: str, recompute: str
) -> None:
    """The engine casts each weight once per step and adds the copies' gradients into the
    fp32 masters itself, the reference casts once per micro-batch and autograd widens: the
    same bits either way (a recomputed forward and a deferred W use the step's copies too; in
    gpt-tiny the head's copy and the embedding's fp32 weight are one tied master), and the
    second step sees the weights the first one stepped."""
    engine = _engine(schedule, 4, precision="bf16", recompute=recompute, model=model_name)
    model = build_layers(layer_specs(model_name), seed=3)
    optimizer = build_optimizer(model, lr=1e-2)
    tokens = torch.randint(0, 256, (8, 17), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        stats = engine.train_step(tokens[:, :-1], tokens[:, 1:])
        loss = reference_step(
            model, optimizer, tokens[:, :-1], tokens[:, 1:], micro_batches=4, precision="bf16"
        )
        assert stats.loss == loss
    for (name, a), b in zip(engine.module.named_parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b), name


def test_bf16_step_casts_each_weight_once_whatever_the_micro_batch_count() -> None:
    tokens = torch.zeros(8, 9, dtype=torch.long)
    casts = []
    for micro_batches in (1, 4, 4):
        engine = _engine("gpipe", micro_batches, precision="bf16")
        with _WeightCasts() as counter:
            engine.train_step(tokens[:, :-1], tokens[:, 1:])
            engine.train_step(tokens[:, :-1], tokens[:, 1:])
        casts.append(counter.count)
    linears = sum(isinstance(m, nn.Linear) for m in engine.module.modules())
    assert casts == [2 * linears] * 3  # two steps, each casting every Linear weight once


def test_gpipe_keeps_every_micro_batch_in_flight_and_1f1b_one() -> None:
    tokens = torch.zeros(8, 9, dtype=torch.long)
    assert _engine("gpipe", 4).train_step(tokens[:, :-1], tokens[:, 1:]).in_flight_peak == {0: 4}
    assert _engine("1f1b", 4).train_step(tokens[:, :-1], tokens[:, 1:]).in_flight_peak == {0: 1}


def test_batch_that_does_not_split_into_micro_batches_is_rejected_before_compute() -> None:
    tokens = torch.zeros(5, 9, dtype=torch.long)
    with pytest.raises(ValueError, match="batch of 5 sequences does not split into 2"):
        _engine("1f1b", 2).train_step(tokens[:, :-1], tokens[:, 1:])


def test_partition_must_have_one_stage_per_pipeline_rank() -> None:
    specs = layer_specs("gpt-tiny")
    with pytest.raises(ValueError, match="partition has 2 stages but the mesh has pp=1"):
        PipelineEngine(
            specs, init_mesh(1), partition=Partition(boundaries=(0, 3, 7)), micro_batches=2
        )


def test_a_schedule_given_as_data_runs_like_its_name() -> None:
    assert _engine(one_f_one_b(1, 2), 2).schedule == _engine("1f1b", 2).schedule


def test_a_schedule_given_as_data_for_another_layout_is_refused_naming_the_fix() -> None:
    with pytest.raises(ValueError, match="schedule '1f1b' runs 4 micro-batches .* has 2"):
        _engine(one_f_one_b(1, 4), 2)


def test_unknown_schedule_lists_the_known_ones() -> None:
    specs = layer_specs("gpt-tiny")
    with pytest.raises(ValueError, match="unknown schedule 'zb'.*gpipe, 1f1b"):
        PipelineEngine(
            specs,
            init_mesh(1),
            partition=Partition(boundaries=(0, 7)),
            micro_batches=2,
            schedule="zb",
        )


def test_first_stage_without_inputs_is_rejected() -> None:
    with pytest.raises(ValueError, match="first pipeline stage needs the batch's inputs"):
        _engine("1f1b", 2).train_step(None, torch.zeros(4, 8, dtype=torch.long))


def test_token_ids_outside_the_vocabulary_are_named_with_the_vocabulary_size() -> None:
    tokens = torch.full((4, 9), 300, dtype=torch.long)  # llama-tiny's vocabulary is 256
    with pytest.raises(RuntimeError, match=r"token ids in \[300, 300\] .* vocabulary has 256"):
        _engine("1f1b", 2).train_step(tokens[:, :-1], tokens[:, 1:])


def test_a_bad_batch_on_the_first_stage_blames_the_batch_not_a_stage_boundary() -> None:
    floats = torch.zeros(4, 8)
    with pytest.raises(RuntimeError, match=r"(?s)dtypes \['float32'\].*input is the batch") as info:
        _engine("1f1b", 2).train_step(floats, torch.zeros(4, 8, dtype=torch.long))
    assert "boundary" not in str(info.value)


def test_a_step_that_fails_midway_drops_its_micro_batches_and_the_next_step_is_exact() -> None:
    tokens = torch.randint(0, 256, (8, 9))
    broken, fresh = _engine("gpipe", 4, "bf16"), _engine("gpipe", 4, "bf16")
    calls = 0

    def fail_on_the_fourth_forward(*_: object) -> None:
        nonlocal calls
        calls += 1
        if calls == 4:
            raise RuntimeError("injected")

    first_layer = next(iter(broken.stages[0].module.layers.values()))
    hook = first_layer.register_forward_hook(fail_on_the_fourth_forward)
    with pytest.raises(RuntimeError, match="injected"):
        broken.train_step(tokens[:, :-1], tokens[:, 1:])
    hook.remove()
    assert broken.stages[0].in_flight == 0
    assert all(p.dtype == torch.float32 for p in broken.module.parameters())
    retried = broken.train_step(tokens[:, :-1], tokens[:, 1:])
    assert retried.loss == fresh.train_step(tokens[:, :-1], tokens[:, 1:]).loss
    for mine, theirs in zip(broken.module.parameters(), fresh.module.parameters(), strict=True):
        assert torch.equal(mine, theirs)


def test_a_closed_engine_refuses_steps_and_closing_twice_is_harmless() -> None:
    tokens = torch.zeros(4, 9, dtype=torch.long)
    with _engine("1f1b", 2) as engine:
        engine.train_step(tokens[:, :-1], tokens[:, 1:])
    engine.close()
    with pytest.raises(RuntimeError, match="PipelineEngine is closed: build a new one"):
        engine.train_step(tokens[:, :-1], tokens[:, 1:])


def test_a_step_inside_the_callers_autocast_is_refused() -> None:
    tokens = torch.zeros(4, 9, dtype=torch.long)
    engine = _engine("1f1b", 2, "bf16")
    with (
        torch.autocast("cpu", dtype=torch.bfloat16),
        pytest.raises(RuntimeError, match="outside autocast"),
    ):
        engine.train_step(tokens[:, :-1], tokens[:, 1:])


def test_recompute_stages_recompute_only_those_stages_and_change_no_bit() -> None:
    """Two stages on one rank (looped BFS), full recompute on stage 1 only."""
    specs = layer_specs("llama-tiny")
    engine = PipelineEngine(
        specs,
        init_mesh(1, 1),
        partition=Partition(boundaries=(0, 3, len(specs))),
        micro_batches=2,
        schedule="looped_bfs",
        stages_per_rank=2,
        seed=3,
        optimizer=lambda m: build_optimizer(m, lr=1e-2),
        options=EngineOptions(recompute="full", recompute_stages=(1,)),
    )
    recomputed = {s: [again for _, again in stage._runs] for s, stage in engine.stages.items()}
    assert recomputed == {0: [False], 1: [True]}
    model = build_layers(specs, seed=3)
    optimizer = build_optimizer(model, lr=1e-2)
    tokens = torch.randint(0, 256, (4, 17), generator=torch.Generator().manual_seed(0))
    stats = engine.train_step(tokens[:, :-1], tokens[:, 1:])
    assert stats.loss == reference_step(
        model, optimizer, tokens[:, :-1], tokens[:, 1:], micro_batches=2
    )
    for (name, a), b in zip(engine.module.named_parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b), name
