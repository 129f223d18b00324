"""Sequence parallelism as data and shapes: the plans the layer classes declare, what one tp
rank holds between its blocks (on torch's fake process group: shapes, not values), what the
memory model predicts, and every input it refuses before a rank starts."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import ClassVar

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate
from torch.testing._internal.distributed.fake_pg import FakeStore

from engine.memory import MemoryConfig
from engine.memory.estimate import MemoryReport, estimate_memory
from engine.parallel import parallelize_layers
from engine.parallel.sequence_parallel import SEQUENCE_ROLES, sequence_plan
from engine.parallel.tensor_parallel import ROLES
from engine.training.config import TrainConfig
from models import layer_specs
from tests.unit.cli_error import cli_error

TP = 2


@pytest.mark.parametrize("model", ["gpt-tiny", "llama-tiny", "llama3-8b", "gpt-small"])
def test_every_sp_plan_names_a_submodule_and_places_every_replicated_module(model: str) -> None:
    for spec in layer_specs(model):
        layer = spec.build("meta")
        plan = sequence_plan(layer)  # raises if a replicated module is left out
        for name, role in plan.items():
            assert role in SEQUENCE_ROLES
            # replaces no split: at most the shared input, which its gather shares as well
            assert getattr(layer, "tp_plan", {}).get(name, "shared_input") == "shared_input"
            layer.get_submodule(name)
        norms = [n for n, m in layer.named_modules() if isinstance(m, nn.LayerNorm | nn.RMSNorm)]
        assert all(plan[n] == "sequence_norm" for n in norms)
        assert set(getattr(layer, "tp_plan", {}).values()) <= set(ROLES)


class _Unplanned(nn.Module):
    tp_plan: ClassVar[dict[str, str]] = {"proj": "colwise"}

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)


class _NormLeftOut(_Unplanned):
    sp_plan: ClassVar[dict[str, str]] = {}


def test_a_layer_without_an_sp_plan_is_refused_naming_the_fix() -> None:
    with pytest.raises(ValueError, match=r"_Unplanned declares no sp_plan .* drop --sequence"):
        sequence_plan(_Unplanned())


def test_a_norm_the_sp_plan_leaves_out_is_refused_naming_it() -> None:
    with pytest.raises(ValueError, match=r"_NormLeftOut\.norm holds weights .* \(sequence_norm"):
        sequence_plan(_NormLeftOut())


@pytest.fixture
def tp_mesh() -> Iterator[DeviceMesh]:
    """Rank 0 of a fake 2-rank world: collectives return tensors of the right shapes."""
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=TP)
    try:
        yield init_device_mesh("cpu", (TP,), mesh_dim_names=("tp",))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("model", ["gpt-tiny", "llama-tiny"])
def test_a_tp_rank_holds_its_sequence_shard_between_blocks_and_the_whole_inside_them(
    model: str, tp_mesh: DeviceMesh
) -> None:
    """Each layer's output, every norm's input and the residual stream are (batch, seq / tp,
    d_model); attention and the MLP see the whole sequence; logits stay split by vocabulary."""
    layers = [spec.build("cpu") for spec in layer_specs(model)]
    parallelize_layers(layers, tp_mesh, sequence_parallel=True)
    seen: dict[str, tuple[int, ...]] = {}
    for layer in layers:
        for module in layer.modules():
            kind = type(module).__name__
            if isinstance(module, nn.LayerNorm | nn.RMSNorm) or kind.endswith(("Attention", "MLP")):
                module.register_forward_pre_hook(_shape_of(seen, kind))
    x = torch.randint(0, 256, (2, 16))
    outputs = []
    for layer in layers:
        x = layer(x)
        outputs.append(tuple(x.shape))
    assert outputs[:-1] == [(2, 8, 64)] * (len(layers) - 1)
    assert outputs[-1] == (2, 16, 256) and isinstance(x, DTensor)
    assert tuple(x.to_local().shape) == (2, 16, 128)
    norm = "LayerNorm" if model == "gpt-tiny" else "RMSNorm"
    mlp = "GELUMLP" if model == "gpt-tiny" else "SwiGLUMLP"
    assert seen == {norm: (2, 8, 64), "CausalSelfAttention": (2, 16, 64), mlp: (2, 16, 64)}
    norms = [m for layer in layers for m in layer.modules() if type(m).__name__ == norm]
    assert all(isinstance(m.weight, DTensor) for m in norms)
    assert all(m.weight.placements == (Replicate(),) for m in norms)


def _shape_of(
    seen: dict[str, tuple[int, ...]], kind: str
) -> Callable[[nn.Module, tuple[torch.Tensor, ...]], None]:
    def hook(_module: nn.Module, inputs: tuple[torch.Tensor, ...]) -> None:
        x = inputs[0]
        seen[kind] = tuple((x.to_local() if isinstance(x, DTensor) else x).shape)

    return hook


def _estimate(sequence_parallel: bool) -> MemoryReport:
    config = MemoryConfig.of(
        model="llama-tiny",
        pp=3,
        tp=TP,
        seq_len=16,
        micro_batches=1,
        recompute="full",
        sequence_parallel=sequence_parallel,
        device="cpu",
    )
    return estimate_memory(config)


def test_the_memory_model_keeps_one_tp_share_of_a_recomputed_stage_input() -> None:
    """With the whole stage recomputed a middle stage keeps only its received input per
    micro-batch: the shard of 1/tp of the sequence under sequence parallelism."""
    plain, split = _estimate(False), _estimate(True)
    assert split.stages[1].kept_per_micro_batch * TP == plain.stages[1].kept_per_micro_batch
    assert all(s.peak < p.peak for s, p in zip(split.stages, plain.stages, strict=True))


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"tp": 1}, r"--sequence-parallel .* but --tp is 1: add --tp 2"),
        ({"tp": 2, "seq_len": 33}, r"--sequence-parallel with --tp 2 and --seq-len 33: .*multiple"),
    ],
)
def test_sequence_parallelism_refuses_what_it_cannot_split(
    settings: dict[str, object], message: str
) -> None:
    for config in (TrainConfig, MemoryConfig):
        with pytest.raises(ValueError, match=message):
            config.of(model="gpt-tiny", sequence_parallel=True, **settings)


def test_meshpipe_train_refuses_sequence_parallelism_without_tp_before_starting_ranks(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, err = cli_error(["train", "--model", "gpt-tiny", "--sequence-parallel"], capsys)
    assert code == 2
    assert "add --tp 2 (or more), or drop --sequence-parallel" in err
