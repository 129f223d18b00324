"""The pp × dp × tp grid as data (which rank sits where), the tensor-parallel plans the layer
classes declare, and every layout tensor parallelism refuses before a rank starts."""

from __future__ import annotations

import re

import pytest
import torch

from engine.comm import mesh
from engine.config import ParallelConfig
from engine.config.parallel import check_tensor_parallel_shape
from engine.parallel.tensor_parallel import ROLES
from engine.training.config import TrainConfig
from models import GPTConfig, LlamaConfig, layer_specs
from tests.unit.cli_error import cli_error

# rank: (pp_rank, dp_rank, tp_rank) of `--pp 2 --dp 2 --tp 2`, the README's table.
GRID_2x2x2 = {
    0: (0, 0, 0),
    1: (0, 0, 1),
    2: (0, 1, 0),
    3: (0, 1, 1),
    4: (1, 0, 0),
    5: (1, 0, 1),
    6: (1, 1, 0),
    7: (1, 1, 1),
}


def test_tp_is_innermost_then_dp_then_pp() -> None:
    assert {r: mesh.coordinates(r, dp=2, tp=2) for r in range(8)} == GRID_2x2x2


@pytest.mark.parametrize(("pp", "dp", "tp"), [(1, 1, 1), (2, 3, 1), (3, 1, 2), (2, 2, 4)])
def test_coordinates_and_rank_of_are_inverse(pp: int, dp: int, tp: int) -> None:
    for rank in range(pp * dp * tp):
        pp_rank, dp_rank, tp_rank = mesh.coordinates(rank, dp=dp, tp=tp)
        assert pp_rank < pp and dp_rank < dp and tp_rank < tp
        assert mesh.rank_of(pp_rank=pp_rank, dp_rank=dp_rank, tp_rank=tp_rank, dp=dp, tp=tp) == rank


def test_a_rank_finds_its_pipeline_peers_in_its_own_column() -> None:
    cpu = torch.device("cpu")
    me = mesh.Mesh(pp=2, dp=2, tp=2, rank=3, pp_rank=0, dp_rank=1, tp_rank=1, device=cpu)
    assert me.world_size == 8
    assert [me.global_rank(pp_rank=p) for p in range(2)] == [3, 7]
    assert me.columns() == [(0, 0), (0, 1), (1, 0), (1, 1)]


def test_a_world_size_other_than_pp_dp_tp_is_refused_naming_all_three(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ValueError, match=r"pp × dp × tp = 2 × 1 × 3 = 6 does not match .* 4"):
        mesh.init_mesh(2, 1, 3, device="cpu")


def test_the_world_size_counts_tensor_parallel_ranks() -> None:
    assert ParallelConfig(pp=2, dp=2, tp=2).world_size == 8


def test_a_tp_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match=r"tp=0 must be at least 1"):
        ParallelConfig(tp=0)


@pytest.mark.parametrize("model", ["gpt-tiny", "llama-tiny", "llama3-8b", "gpt-small"])
def test_every_plan_names_a_submodule_with_a_known_role(model: str) -> None:
    for spec in layer_specs(model):
        layer = spec.build("meta")
        plan = getattr(layer, "tp_plan", {})
        for name, role in plan.items():
            assert role in ROLES
            target = layer if name == "" else layer.get_submodule(name)
            if role == "shared_input":  # a module whose column-wise Linears read its input
                inside = [r for n, r in plan.items() if n.startswith(name + ".")]
                assert inside.count("colwise") >= 2
            else:
                assert isinstance(target, torch.nn.Linear | torch.nn.Embedding)


def test_tp_not_dividing_the_heads_is_refused_with_the_choices() -> None:
    heads = r"--tp 3 does not divide gpt-tiny's attention heads .* of 4.*\[1, 2, 4\]"
    with pytest.raises(ValueError, match=heads):
        TrainConfig.of(model="gpt-tiny", tp=3)


def test_tp_not_dividing_the_kv_heads_is_refused() -> None:
    with pytest.raises(ValueError, match=r"--tp 4 does not divide llama-tiny's key/value heads"):
        TrainConfig.of(model="llama-tiny", tp=4)


def test_tp_not_dividing_the_mlp_size_is_refused() -> None:
    config = LlamaConfig(
        vocab_size=256, n_layer=1, n_head=4, n_kv_head=4, d_model=64, ffn_hidden=170, max_seq_len=8
    )
    with pytest.raises(ValueError, match=r"--tp 4 does not divide m's MLP size of 170"):
        check_tensor_parallel_shape("m", config, 4)


def test_tp_not_dividing_the_vocabulary_is_refused() -> None:
    config = GPTConfig(vocab_size=250, n_layer=1, n_head=4, d_model=64, max_seq_len=8)
    with pytest.raises(ValueError, match=r"--tp 4 does not divide m's vocabulary .* of 250"):
        check_tensor_parallel_shape("m", config, 4)


@pytest.mark.parametrize(
    ("settings", "named"),
    [
        ({"pp": 2, "seq_len": 33}, "--seq-len 33"),
        ({"optimizer_impl": "deepspeed_cpu"}, "--optimizer-impl deepspeed_cpu"),
        ({"optimizer": "sgd"}, "--optimizer sgd --optimizer-impl fused"),
    ],
)
def test_what_tensor_parallel_stages_cannot_run_is_refused_by_name(
    settings: dict[str, object], named: str
) -> None:
    with pytest.raises(ValueError, match=rf"--tp 2 with {re.escape(named)}.*(use|drop) "):
        TrainConfig.of(model="gpt-tiny", tp=2, **settings)


def test_zero3_shards_tensor_parallel_stages_over_the_replicas() -> None:
    config = TrainConfig.of(model="llama-tiny", tp=2, dp=2, zero=3, optimizer_impl="per_tensor")
    assert (config.parallel.tp, config.engine.zero) == (2, 3)


@pytest.mark.parametrize("zero", [1, 2])
@pytest.mark.parametrize(
    "optimizer", [{}, {"optimizer": "sgd"}, {"optimizer_impl": "deepspeed_cpu"}], ids=str
)
def test_zero1_and_2_shard_the_tp_shards_flat_buffers_with_any_optimizer_kernel(
    zero: int, optimizer: dict[str, str]
) -> None:
    """ZeRO-1/2's optimizer steps plain flat tensors (this tp rank's shards, flattened), so
    the kernels that cannot step DTensors run there."""
    config = TrainConfig.of(model="llama-tiny", tp=2, dp=2, zero=zero, **optimizer)
    assert (config.parallel.tp, config.engine.zero) == (2, zero)


def test_meshpipe_train_refuses_a_bad_tp_before_starting_ranks(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, err = cli_error(["train", "--model", "gpt-tiny", "--pp", "2", "--tp", "3"], capsys)
    assert code == 2
    assert "--tp 3 does not divide gpt-tiny's attention heads" in err
