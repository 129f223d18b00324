"""`compile`: each layer through torch.compile, the same numbers to rounding, and refused where
a split backward needs the Linears a compiled layer hides."""

from __future__ import annotations

import shutil

import pytest
import torch
from torch._dynamo.utils import counters

from engine.comm.mesh import init_mesh
from engine.config import EngineOptions
from engine.runtime.engine import PipelineEngine
from engine.runtime.optim import build_optimizer
from engine.runtime.stage import PipelineStage
from engine.schedule.actions import parse_actions
from engine.schedule.schedule import Schedule
from engine.training.config import TrainConfig
from models import layer_specs
from partitioners import Partition

torch.set_num_threads(1)
SPECS = layer_specs("llama-tiny")
needs_compiler = pytest.mark.skipif(
    shutil.which("g++") is None and shutil.which("c++") is None,
    reason="torch.compile on the CPU needs a C++ compiler",
)


def _stage(*, compile: bool) -> PipelineStage:
    return PipelineStage(
        SPECS, stage=0, layers=range(len(SPECS)), num_stages=1, seed=0, compile=compile
    )


def _loss_and_grads(stage: PipelineStage) -> tuple[torch.Tensor, list[torch.Tensor]]:
    tokens = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(0))
    (loss,) = stage.forward(0, (tokens[:, :-1],), targets=tokens[:, 1:])
    stage.backward(0)
    return loss, [p.grad for p in stage.module.parameters()]  # type: ignore[misc]


@needs_compiler
def test_a_compiled_stage_computes_what_the_eager_one_does_to_rounding() -> None:
    eager_loss, eager_grads = _loss_and_grads(_stage(compile=False))
    loss, grads = _loss_and_grads(_stage(compile=True))
    torch.testing.assert_close(loss, eager_loss, rtol=1e-5, atol=1e-6)
    for got, expected in zip(grads, eager_grads, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-6)


@needs_compiler
def test_a_compiled_stage_runs_its_layers_as_compiled_graphs() -> None:
    """Not a silent fallback to eager: the stage's output comes out of a compiled graph."""
    stage = PipelineStage(SPECS, stage=0, layers=range(2), num_stages=2, seed=0, compile=True)
    (out,) = stage.forward(0, (torch.zeros(2, 16, dtype=torch.long),))
    assert type(out.grad_fn).__name__ == "CompiledFunctionBackward"


def _bf16_engine(*, compile: bool, micro_batches: int, schedule: str) -> PipelineEngine:
    return PipelineEngine(
        SPECS,
        init_mesh(1, 1, device="cpu"),
        partition=Partition(boundaries=(0, len(SPECS))),
        micro_batches=micro_batches,
        schedule=schedule,
        options=EngineOptions(precision="bf16", compile=compile),
        optimizer=lambda m: build_optimizer(m, lr=1e-2),
    )


def _bf16_engine_step(*, compile: bool) -> tuple[float, list[torch.Tensor]]:
    engine = _bf16_engine(compile=compile, micro_batches=4, schedule="gpipe")
    tokens = torch.randint(0, 256, (8, 17), generator=torch.Generator().manual_seed(0))
    loss = engine.train_step(tokens[:, :-1], tokens[:, 1:]).loss
    return loss, [p.grad.clone() for p in engine.module.parameters()]  # type: ignore[union-attr]


@needs_compiler
def test_compiled_bf16_micro_batches_sharing_a_step_match_eager_to_rounding() -> None:
    """Compiled layers under the engine's per-step casts (four micro-batches in flight) give
    the eager engine's loss and gradients to bf16 rounding (fused kernels round elsewhere)."""
    eager_loss, eager_grads = _bf16_engine_step(compile=False)
    loss, grads = _bf16_engine_step(compile=True)
    assert loss == pytest.approx(eager_loss, rel=1e-3)
    for got, expected in zip(grads, eager_grads, strict=True):
        assert torch.linalg.vector_norm(got - expected) <= 2e-2 * torch.linalg.vector_norm(expected)


@needs_compiler
def test_a_compiled_bf16_engine_compiles_in_its_first_step_only() -> None:
    """Each step's weight copies are new tensors of the same dtype: no recompilation."""
    engine = _bf16_engine(compile=True, micro_batches=2, schedule="1f1b")
    tokens = torch.zeros(4, 9, dtype=torch.long)
    engine.train_step(tokens[:, :-1], tokens[:, 1:])
    graphs = counters["stats"]["unique_graphs"]
    for _ in range(2):
        engine.train_step(tokens[:, :-1], tokens[:, 1:])
    assert counters["stats"]["unique_graphs"] == graphs


def test_compiling_keeps_the_parameter_names_checkpoints_use() -> None:
    assert list(_stage(compile=True).module.state_dict()) == list(
        _stage(compile=False).module.state_dict()
    )


def test_a_compiled_stage_refuses_the_split_backward_naming_the_schedules_that_work() -> None:
    with pytest.raises(ValueError, match=r"compiled.*1f1b, gpipe, interleaved_1f1b"):
        _stage(compile=True).enable_split_backward()


def test_the_engine_refuses_a_split_backward_schedule_with_compile() -> None:
    with pytest.raises(ValueError, match="compiled"):
        PipelineEngine(
            SPECS,
            init_mesh(1, 1, device="cpu"),
            partition=Partition(boundaries=(0, len(SPECS))),
            micro_batches=2,
            schedule=Schedule(
                name="custom",
                num_ranks=1,
                num_stages=1,
                micro_batches=2,
                placement=(0,),
                rows=(tuple(parse_actions("0F0 0I0 0F1 0I1 0W0 0W1")),),
            ),
            options=EngineOptions(compile=True),
            optimizer=lambda m: build_optimizer(m, lr=1e-2),
        )


def test_a_run_asking_for_compile_and_a_zero_bubble_schedule_fails_before_launch() -> None:
    with pytest.raises(ValueError, match=r"--compile with schedule zb_h1.*use 1f1b"):
        TrainConfig.of(model="gpt-tiny", pp=2, schedule="zb_h1", compile=True)


def test_a_run_on_an_unknown_device_is_refused_naming_the_choices() -> None:
    with pytest.raises(ValueError, match=r"unknown device 'gpu': choose one of auto, cuda, cpu"):
        TrainConfig.of(model="gpt-tiny", device="gpu")
