"""scripts/bench_stage.py: one stage's throughput and MFU, with its FLOPs and peaks right."""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from models import MODEL_CONFIGS, layer_specs

torch.set_num_threads(1)
SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_stage.py"


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_stage", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass resolves annotations through it
    spec.loader.exec_module(module)
    return module


def test_a_middle_stage_holds_every_block_and_nothing_else(bench: ModuleType) -> None:
    specs = layer_specs(MODEL_CONFIGS["llama-tiny"])
    chosen = bench.stage_layers(specs, "blocks")
    assert [specs[i].name for i in chosen] == ["block"] * MODEL_CONFIGS["llama-tiny"].n_layer
    result = bench.measure_stage("llama-tiny", micro_batch_size=2, seq_len=32, steps=1, warmup=0)
    blocks = sum(p.numel() for i in chosen for p in specs[i].build("meta").parameters())
    assert result.params == blocks


def test_achieved_flops_are_three_forwards_over_the_measured_time(bench: ModuleType) -> None:
    result = bench.measure_stage(
        "gpt-tiny", layers="all", micro_batch_size=2, seq_len=16, steps=2, warmup=1, peak=1.0
    )
    specs = layer_specs(MODEL_CONFIGS["gpt-tiny"])
    flops = 3 * sum(spec.forward_flops(2, 16) for spec in specs)
    seconds = (result.forward_ms + result.backward_ms) / 1e3
    assert result.tflops * 1e12 * seconds == pytest.approx(flops, rel=1e-9)
    assert result.tokens_per_s * seconds == pytest.approx(2 * 16, rel=1e-9)
    assert result.mfu == pytest.approx(result.tflops / 1.0)


def test_the_split_backward_is_measured_in_low_precision_too(bench: ModuleType) -> None:
    result = bench.measure_stage(
        "llama-tiny", precision="bf16", split=True, micro_batch_size=2, seq_len=16, steps=1
    )
    assert result.split and result.precision == "bf16"
    assert result.forward_ms > 0 and result.backward_ms > 0


def test_a_cpu_has_no_known_peak_so_no_mfu(bench: ModuleType) -> None:
    assert bench.peak_tflops(torch.device("cpu"), "bf16") is None
    result = bench.measure_stage("llama-tiny", layers="0:2", micro_batch_size=1, seq_len=8, steps=1)
    assert result.mfu is None and result.peak_memory_gib is None


@pytest.mark.parametrize(
    ("name", "peak"),
    [
        ("NVIDIA H100 80GB HBM3", 989.4),
        ("NVIDIA H100 PCIe", 756.0),
        ("NVIDIA H200", 989.4),
        ("NVIDIA A100-SXM4-80GB", 312.0),
        ("NVIDIA GeForce RTX 4090", None),
    ],
)
def test_gpu_peaks_are_looked_up_by_device_name(
    bench: ModuleType, monkeypatch: pytest.MonkeyPatch, name: str, peak: float | None
) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert bench.peak_tflops(torch.device("cuda"), "bf16") == peak


@pytest.mark.parametrize("text", ["5:3", "first:3", "3", "9:"])
def test_a_layer_range_that_selects_nothing_names_the_valid_range(
    bench: ModuleType, text: str
) -> None:
    specs = layer_specs(MODEL_CONFIGS["llama-tiny"])
    with pytest.raises(ValueError, match=r"give blocks, all, or a:b with 0 <= a < b <= 7"):
        bench.stage_layers(specs, text)


def test_runtime_overhead_times_the_engine_against_the_bare_stage(bench: ModuleType) -> None:
    overhead = bench.measure_runtime_overhead(
        "gpt-tiny", micro_batch_size=1, seq_len=8, micro_batches=2, steps=1, warmup=0
    )
    assert overhead.micro_batches == 2
    assert overhead.bare_ms > 0 and overhead.engine_ms > 0
    assert overhead.overhead_ms == overhead.engine_ms - overhead.bare_ms


def test_a_step_of_micro_batches_is_timed_per_micro_batch(bench: ModuleType) -> None:
    result = bench.measure_stage(
        "llama-tiny", precision="bf16", micro_batch_size=1, seq_len=8, steps=1, micro_batches=3
    )
    assert result.micro_batches == 3
    seconds = (result.forward_ms + result.backward_ms) / 1e3
    assert result.tokens_per_s * seconds == pytest.approx(8, rel=1e-9)


def test_each_step_is_one_sample_the_mean_of_its_micro_batches(bench: ModuleType) -> None:
    class Clock:
        def seconds(self) -> list[float]:
            return [0.0, 1.0, 3.0, 3.0, 6.0, 7.0, 7.0, 8.0, 9.0, 9.0, 10.0, 12.0]

    marks = [(0, 1, 2), (3, 4, 5), (6, 7, 8), (9, 10, 11)]  # two steps of two micro-batches
    assert bench._medians(Clock(), marks, 2) == pytest.approx((1.5, 1.5))


def test_casts_name_the_three_ways_to_cast(bench: ModuleType) -> None:
    with pytest.raises(ValueError, match="choose one of step, autocast-step, micro-batch"):
        bench.measure_stage("llama-tiny", micro_batch_size=1, seq_len=8, steps=1, casts="once")


@pytest.mark.skipif(
    shutil.which("g++") is None and shutil.which("c++") is None,
    reason="torch.compile on the CPU needs a C++ compiler",
)
def test_a_compile_mode_compiles_every_layer_of_the_stage_with_it(
    bench: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    modes: list[str | None] = []
    compile_layer = torch.nn.Module.compile

    def spy(module: torch.nn.Module, *args: object, **kwargs: object) -> None:
        modes.append(kwargs.get("mode"))  # type: ignore[arg-type]
        compile_layer(module, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(torch.nn.Module, "compile", spy)
    result = bench.measure_stage(
        "llama-tiny", layers="1:3", micro_batch_size=1, seq_len=8, steps=1, warmup=0,
        compile=True, compile_mode="max-autotune-no-cudagraphs",
    )  # fmt: skip
    assert modes[-2:] == ["max-autotune-no-cudagraphs"] * 2  # the last word for both layers
    assert result.compiled and result.compile_mode == "max-autotune-no-cudagraphs"


def test_a_compile_mode_without_compile_is_refused(
    bench: ModuleType, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(sys, "argv", ["bench_stage.py", "--compile-mode", "default"])
    with pytest.raises(SystemExit):
        bench.main()
    assert "--compile-mode sets how --compile compiles: add --compile" in capsys.readouterr().err
