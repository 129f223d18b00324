"""`profile:` costs: one stage built at a time, once, and refused when this host cannot hold it."""

from __future__ import annotations

import contextlib
import gc
import math
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

import engine.plan.profile
import engine.runtime.weight_grads
from engine.cli.main import main
from engine.memory.states import stage_params
from engine.plan.hardware import STEP_BYTES_PER_PARAMETER
from engine.plan.profile import measured_split_forward, profile_stage_costs, stage_profile_bytes
from engine.runtime.stage import PipelineStage
from models import LayerSpec, layer_specs
from partitioners import Partition, partition_model


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """Timings on one thread: a benchmark beside the tests skews two-thread medians most."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _partition(model: str, stages: int, seq_len: int) -> tuple[list[LayerSpec], Partition]:
    specs = layer_specs(model)
    return specs, partition_model(
        specs, method="balanced", num_stages=stages, batch_size=1, seq_len=seq_len
    )


def test_a_stage_too_large_for_the_available_memory_is_refused_before_it_is_built(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(engine.plan.profile, "available_memory", lambda: 8 * 2**30)

    def built(*_: object, **__: object) -> None:
        raise AssertionError("a stage was built before the memory check")

    monkeypatch.setattr(engine.plan.profile, "PipelineStage", built)
    specs, partition = _partition("llama-7b", 4, 64)
    with pytest.raises(ValueError) as error:
        profile_stage_costs(specs, partition, seq_len=64)
    message = str(error.value)
    assert "profiling stage 3 (layers [25, 35)) needs about 13.9 GiB" in message
    assert "8.0 GiB available" in message
    for fix in ("--pp", "--seq-len", "--micro-batch-size", "--costs F,B,I,W"):
        assert fix in message


def test_the_schedule_command_exits_2_with_the_refusal(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(engine.plan.profile, "available_memory", lambda: 2**30)
    argv = ["schedule", "--pp", "4", "--costs", "profile:llama-7b", "--seq-len", "64"]
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    assert "1.0 GiB available" in capsys.readouterr().err


def test_the_estimate_holds_weights_and_gradients_in_fp32() -> None:
    specs, partition = _partition("llama-7b", 4, 64)
    layers = partition.layers_of(1)
    params = sum(specs[i].num_parameters() for i in layers)
    estimate = stage_profile_bytes(specs, layers, batch_size=1, seq_len=64)
    assert 8 * params < estimate < 9 * params


def test_available_memory_reads_meminfo_and_is_skipped_without_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemAvailable:   20000000 kB\n")
    monkeypatch.setattr(engine.plan.profile, "_MEMINFO", meminfo)
    assert engine.plan.profile.available_memory() == 20000000 * 1024
    monkeypatch.setattr(engine.plan.profile, "_MEMINFO", tmp_path / "missing")
    assert engine.plan.profile.available_memory() is None
    specs, partition = _partition("gpt-tiny", 2, 16)
    per_stage = profile_stage_costs(specs, partition, seq_len=16, repeats=1).per_stage
    assert per_stage is not None and len(per_stage) == 2


def test_each_stage_is_built_once_and_its_w_runs_the_deferred_gemms(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    built: list[int] = []
    gemms: list[int] = []

    class Counted(PipelineStage):
        def __init__(self, *args: object, **kwargs: object) -> None:
            super().__init__(*args, **kwargs)  # type: ignore[arg-type]
            built.append(self.stage)

    linear_grads = engine.runtime.weight_grads.linear_weight_grads

    def counted(*args: object) -> list[torch.Tensor]:
        gemms.append(1)
        return linear_grads(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(engine.plan.profile, "PipelineStage", Counted)
    monkeypatch.setattr(engine.runtime.weight_grads, "linear_weight_grads", counted)
    specs, partition = _partition("llama-tiny", 2, 32)
    profile_stage_costs(specs, partition, seq_len=32, repeats=2)
    assert built == [0, 1]
    linears = sum(
        isinstance(m, torch.nn.Linear) for spec in specs for m in spec.build("meta").modules()
    )
    assert len(gemms) == 3 * linears  # warm-up and two timed micro-batches, every Linear


def test_a_stage_is_freed_before_the_next_is_built(monkeypatch: pytest.MonkeyPatch) -> None:
    alive: list[list[bool]] = []
    stages: list[weakref.ref[PipelineStage]] = []

    class Watched(PipelineStage):
        def __init__(self, *args: object, **kwargs: object) -> None:
            alive.append([ref() is not None for ref in stages])
            super().__init__(*args, **kwargs)  # type: ignore[arg-type]
            stages.append(weakref.ref(self))

    monkeypatch.setattr(engine.plan.profile, "PipelineStage", Watched)
    specs, partition = _partition("llama-tiny", 3, 16)
    with _collector_off():
        profile_stage_costs(specs, partition, seq_len=16, repeats=1)
    assert alive == [[], [False], [False, False]]


@contextlib.contextmanager
def _collector_off() -> Iterator[None]:
    """Automatic collection off, so only an explicit `gc.collect()` frees a cycle."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def test_a_tiny_model_gets_four_positive_costs_per_stage() -> None:
    """F, B, I and W each timed per stage. How I + W compares with B is a speed, measured by
    scripts/ and not asserted here: under a loaded CI machine one pass ran 2.4× the other."""
    specs, partition = _partition("llama-tiny", 2, 128)
    per_stage = profile_stage_costs(
        specs, partition, batch_size=2, seq_len=128, repeats=5
    ).per_stage
    assert per_stage is not None and len(per_stage) == 2
    for costs in per_stage:
        assert len(costs) == 4 and all(math.isfinite(t) and t > 0 for t in costs)


def test_a_split_profile_times_each_layer_as_the_engine_splits_it_on_a_fake_world(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    specs = layer_specs("llama-tiny")
    built: list[tuple[range, int]] = []
    build = engine.plan.profile.build_sharded_layers

    def recording(specs: list[LayerSpec], indices: range, **kwargs: object) -> object:
        mesh = kwargs["tp_mesh"]
        assert isinstance(mesh, torch.distributed.device_mesh.DeviceMesh)
        built.append((indices, mesh.size()))
        return build(specs, indices, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(engine.plan.profile, "build_sharded_layers", recording)
    seconds = measured_split_forward(specs, 2, 32, tp=2, repeats=1)
    assert len(seconds) == len(specs) and min(seconds) > 0
    assert built == [(range(i, i + 1), 2) for i in range(len(specs))]
    assert not torch.distributed.is_initialized()  # the fake world is torn down


def test_a_split_profile_of_one_rank_is_refused() -> None:
    with pytest.raises(ValueError, match="tp=1"):
        measured_split_forward(layer_specs("llama-tiny"), 1, 32, tp=1)


def _timed_once(monkeypatch: pytest.MonkeyPatch, calls: list[str]) -> None:
    """`median_seconds` runs the step once and reports a second; the phase's parts are logged."""
    norm, clip = engine.plan.profile.global_grad_norm, engine.plan.profile.clip_gradients

    def once(run: Callable[[], object], repeats: int) -> float:
        run()
        return 1.0

    def logged_norm(named: list[tuple[str, torch.nn.Parameter]], order: dict[str, int]) -> object:
        calls.append(f"norm of {len(named)}")
        return norm(named, order)

    def logged_clip(params: list[torch.nn.Parameter], total: torch.Tensor, most: float) -> None:
        calls.append(f"clip {len(params)} at {most}")
        clip(params, total, most)

    monkeypatch.setattr(engine.plan.profile, "median_seconds", once)
    monkeypatch.setattr(engine.plan.profile, "global_grad_norm", logged_norm)
    monkeypatch.setattr(engine.plan.profile, "clip_gradients", logged_clip)


def test_the_optimizer_phase_is_timed_over_the_models_own_tensors_as_the_engine_runs_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each tensor costs calls and launches beside its bytes, so the rate is the model's:
    gpt-tiny's every parameter, its norm taken and clipped at train's default, then AdamW."""
    calls: list[str] = []
    _timed_once(monkeypatch, calls)
    params = stage_params(layer_specs("gpt-tiny"))
    rate = engine.plan.profile.measured_memory_bandwidth(layer_specs("gpt-tiny"))
    assert rate == STEP_BYTES_PER_PARAMETER * sum(p.numel for p in params)
    assert calls == [f"norm of {len(params)}", f"clip {len(params)} at 1.0"]


def test_a_large_models_optimizer_phase_is_timed_over_its_first_parameters_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """gpt2's 124 M parameters would take seconds a step: its first 4 Mi, the last one cut."""
    calls: list[str] = []
    _timed_once(monkeypatch, calls)
    rate = engine.plan.profile.measured_memory_bandwidth(layer_specs("gpt2"))
    assert rate == STEP_BYTES_PER_PARAMETER * 4 * 2**20
    wte = stage_params(layer_specs("gpt2"))[0]  # 38.6 M: it alone is timed, cut to 4 Mi
    assert wte.numel > 4 * 2**20 and calls[0] == "norm of 1"
