"""ZeRO-1/2 on one rank (dp = 1): the flat buffers, the low-precision weights with fp32 main
gradients and the flat-shard optimizer change no bit against the single-process reference."""

from __future__ import annotations

import pytest
import torch

from engine.comm.mesh import init_mesh
from engine.config import EngineOptions, OptimizerSpec
from engine.runtime.engine import PipelineEngine, _check_unshared
from engine.runtime.optim import build_from_spec
from engine.runtime.reference import reference_step
from engine.training.config import TrainConfig
from models import build_layers, layer_specs
from partitioners import Partition

SPEC = OptimizerSpec(name="adamw", lr=1e-2, weight_decay=0.1)


def _masters(engine: PipelineEngine) -> dict[str, torch.Tensor]:
    """Each parameter's fp32 master (the weight itself when fp32)."""
    assert engine.sharded is not None
    masters = engine.sharded.full_masters()
    return {n: masters[id(p)] for n, p in engine.module.named_parameters()}


@pytest.mark.parametrize(
    ("model", "schedule", "precision", "zero", "recompute", "clip"),
    [
        ("llama-tiny", "1f1b", "fp32", 1, "none", 0.0),
        ("llama-tiny", "1f1b", "bf16", 1, "none", 0.5),
        ("llama-tiny", "zb_h1", "bf16", 2, "none", 0.5),
        ("gpt-tiny", "1f1b", "bf16", 2, "full", 0.0),
        ("gpt-tiny", "1f1b", "fp16", 1, "none", 0.5),
    ],
)
def test_zero_on_one_rank_equals_the_reference_bit_for_bit(
    model: str, schedule: str, precision: str, zero: int, recompute: str, clip: float
) -> None:
    specs = layer_specs(model)
    engine = PipelineEngine(
        specs,
        init_mesh(1, 1),
        partition=Partition(boundaries=(0, len(specs))),
        micro_batches=4,
        schedule=schedule,
        seed=3,
        optimizer=SPEC,
        options=EngineOptions(
            precision=precision, zero=zero, recompute=recompute, clip_grad_norm=clip
        ),
    )
    reference = build_layers(specs, seed=3)
    optimizer = build_from_spec(SPEC, reference)
    scaler = engine.scaler.__class__() if engine.scaler is not None else None
    tokens = torch.randint(0, 256, (8, 17), generator=torch.Generator().manual_seed(0))
    for _ in range(3):
        stats = engine.train_step(tokens[:, :-1], tokens[:, 1:])
        loss = reference_step(
            reference,
            optimizer,
            tokens[:, :-1],
            tokens[:, 1:],
            micro_batches=4,
            precision=precision,
            clip_grad_norm=clip,
            scaler=scaler,
        )
        assert stats.loss == loss
    masters = _masters(engine)
    for (name, ours), theirs in zip(masters.items(), reference.parameters(), strict=True):
        assert torch.equal(ours, theirs), name


def test_zero3_refuses_a_weight_two_layers_of_one_rank_share() -> None:
    """gpt-tiny's embedding and head share a weight: FSDP would shard it twice."""
    layers = build_layers(layer_specs("gpt-tiny"), seed=0).layers.values()
    with pytest.raises(ValueError, match="place them on different pipeline ranks"):
        _check_unshared(list(layers), 0)


def test_zero3_in_one_process_is_refused_naming_the_launch() -> None:
    specs = layer_specs("llama-tiny")
    with pytest.raises(ValueError, match="needs torch.distributed: launch the run"):
        PipelineEngine(
            specs,
            init_mesh(1, 1),
            partition=Partition(boundaries=(0, len(specs))),
            micro_batches=2,
            optimizer=OptimizerSpec(lr=1e-2, impl="per_tensor"),
            options=EngineOptions(zero=3),
        )


def test_zero3_with_a_fused_optimizer_is_refused_before_any_rank_starts() -> None:
    with pytest.raises(ValueError, match="--optimizer-impl per_tensor"):
        TrainConfig.of(zero=3, dp=2)


def test_zero_with_an_optimizer_factory_is_refused_naming_the_spec() -> None:
    specs = layer_specs("llama-tiny")
    with pytest.raises(ValueError, match="needs an OptimizerSpec"):
        PipelineEngine(
            specs,
            init_mesh(1, 1),
            partition=Partition(boundaries=(0, len(specs))),
            micro_batches=2,
            optimizer=lambda module: build_from_spec(SPEC, module),
            options=EngineOptions(zero=2),
        )


def test_an_unknown_zero_level_names_the_levels() -> None:
    with pytest.raises(ValueError, match="choose a ZeRO level among 0, 1, 2, 3"):
        EngineOptions(zero=4)
