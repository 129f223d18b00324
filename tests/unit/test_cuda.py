"""On a GPU (skipped without one; CI has none): the engine takes the loader's CPU batches,
compiled layers compute what eager ones do, and two ranks can share one GPU over gloo."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.comm.mesh import init_mesh
from engine.plan import measured_forward, measured_memory_bandwidth
from engine.runtime.engine import PipelineEngine
from engine.runtime.optim import build_optimizer
from engine.runtime.reference import reference_step
from engine.runtime.stage import PipelineStage
from models import build_layers, layer_specs
from partitioners import Partition

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA device and MESHPIPE_TEST_CUDA=1 (tests/conftest.py hides GPUs otherwise)",
)
ROOT = Path(__file__).resolve().parents[2]
SPECS = layer_specs("llama-tiny")


def test_a_single_gpu_engine_trains_from_cpu_batches_as_the_reference_on_the_gpu() -> None:
    mesh = init_mesh(1, 1, device="cuda")
    engine = PipelineEngine(
        SPECS,
        mesh,
        partition=Partition(boundaries=(0, len(SPECS))),
        micro_batches=4,
        seed=3,
        optimizer=lambda m: build_optimizer(m, lr=1e-2),
    )
    model = build_layers(SPECS, seed=3, device=mesh.device)
    optimizer = build_optimizer(model, lr=1e-2)
    tokens = torch.randint(0, 256, (8, 17), generator=torch.Generator().manual_seed(0))
    on_gpu = tokens.to(mesh.device)
    for _ in range(2):
        loss = engine.train_step(tokens[:, :-1], tokens[:, 1:]).loss
        expected = reference_step(model, optimizer, on_gpu[:, :-1], on_gpu[:, 1:], micro_batches=4)
        assert loss == pytest.approx(expected, rel=1e-6)
    for a, b in zip(engine.module.parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_compiled_bf16_stage_computes_what_the_eager_one_does_on_the_gpu() -> None:
    tokens = torch.randint(0, 256, (2, 65), generator=torch.Generator().manual_seed(0)).cuda()
    losses = []
    for compile in (False, True):
        stage = PipelineStage(
            SPECS, stage=0, layers=range(len(SPECS)), num_stages=1, seed=0, device="cuda",
            precision="bf16", compile=compile,
        )  # fmt: skip
        (loss,) = stage.forward(0, (tokens[:, :-1],), targets=tokens[:, 1:])
        stage.backward(0)
        losses.append(float(loss))
    assert losses[1] == pytest.approx(losses[0], rel=1e-2)


def _losses(tmp_path: Path, device: str) -> list[float]:
    metrics = tmp_path / f"{device}.jsonl"
    command = [
        sys.executable, "-m", "engine.cli", "train", "--model", "gpt-tiny", "--pp", "2",
        "--steps", "3", "--global-batch", "8", "--micro-batches", "4", "--seq-len", "32",
        "--device", device, "--metrics-file", str(metrics), "--no-progress", "--timeout", "120",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    subprocess.run(command, cwd=ROOT, env=env, check=True, timeout=300)
    return [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]


def test_two_ranks_sharing_one_gpu_over_gloo_train_as_on_the_cpu(tmp_path: Path) -> None:
    if torch.cuda.device_count() > 1:
        pytest.skip("with a GPU per rank the ranks use NCCL")
    assert _losses(tmp_path, "cuda") == pytest.approx(_losses(tmp_path, "cpu"), rel=1e-4)


def test_the_layers_and_the_optimizer_phase_are_timed_on_the_gpu() -> None:
    """What `scripts/plan_check.py --device cuda` prices a plan by: each layer's forward and
    backward and the optimizer phase on the GPU, each timing waiting for its kernels."""
    forward = measured_forward(SPECS, 2, 32, repeats=1, device="cuda")
    assert len(forward) == len(SPECS) and min(forward) > 0
    assert measured_memory_bandwidth(SPECS, repeats=1, device="cuda") > 0
