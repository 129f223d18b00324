"""`--mesh-order`: where each (pp, dp, tp) coordinate sits in the global rank, for every
order of the three dimensions, and the orders refused before a rank starts."""

from __future__ import annotations

import itertools

import pytest
import torch

from engine.comm import mesh
from engine.config import MESH_DIMS, ParallelConfig
from engine.training.config import TrainConfig
from tests.unit.cli_error import cli_error

ORDERS = list(itertools.permutations(MESH_DIMS))

# rank: (pp_rank, dp_rank, tp_rank) of `--pp 2 --dp 3 --tp 2`, per order (outermost first).
GRID_2x3x2 = {
    ("pp", "dp", "tp"): [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1), (0, 2, 0), (0, 2, 1),
                         (1, 0, 0), (1, 0, 1), (1, 1, 0), (1, 1, 1), (1, 2, 0), (1, 2, 1)],
    ("dp", "pp", "tp"): [(0, 0, 0), (0, 0, 1), (1, 0, 0), (1, 0, 1), (0, 1, 0), (0, 1, 1),
                         (1, 1, 0), (1, 1, 1), (0, 2, 0), (0, 2, 1), (1, 2, 0), (1, 2, 1)],
    ("tp", "dp", "pp"): [(0, 0, 0), (1, 0, 0), (0, 1, 0), (1, 1, 0), (0, 2, 0), (1, 2, 0),
                         (0, 0, 1), (1, 0, 1), (0, 1, 1), (1, 1, 1), (0, 2, 1), (1, 2, 1)],
    ("pp", "tp", "dp"): [(0, 0, 0), (0, 1, 0), (0, 2, 0), (0, 0, 1), (0, 1, 1), (0, 2, 1),
                         (1, 0, 0), (1, 1, 0), (1, 2, 0), (1, 0, 1), (1, 1, 1), (1, 2, 1)],
    ("dp", "tp", "pp"): [(0, 0, 0), (1, 0, 0), (0, 0, 1), (1, 0, 1), (0, 1, 0), (1, 1, 0),
                         (0, 1, 1), (1, 1, 1), (0, 2, 0), (1, 2, 0), (0, 2, 1), (1, 2, 1)],
    ("tp", "pp", "dp"): [(0, 0, 0), (0, 1, 0), (0, 2, 0), (1, 0, 0), (1, 1, 0), (1, 2, 0),
                         (0, 0, 1), (0, 1, 1), (0, 2, 1), (1, 0, 1), (1, 1, 1), (1, 2, 1)],
}  # fmt: skip


@pytest.mark.parametrize("order", ORDERS, ids=",".join)
def test_each_order_places_the_coordinates_as_its_table_says(order: tuple[str, ...]) -> None:
    placed = [mesh.coordinates(r, pp=2, dp=3, tp=2, order=order) for r in range(12)]
    assert placed == GRID_2x3x2[order]


@pytest.mark.parametrize("order", ORDERS, ids=",".join)
def test_rank_of_inverts_coordinates_in_each_order(order: tuple[str, ...]) -> None:
    sizes = {"pp": 3, "dp": 2, "tp": 4}
    for rank in range(24):
        pp_rank, dp_rank, tp_rank = mesh.coordinates(rank, **sizes, order=order)
        at = {"pp_rank": pp_rank, "dp_rank": dp_rank, "tp_rank": tp_rank}
        assert mesh.rank_of(**at, **sizes, order=order) == rank


def test_the_default_order_is_pp_outermost_and_tp_innermost() -> None:
    assert ParallelConfig().mesh_order == ("pp", "dp", "tp")
    one = mesh.Mesh(pp=1, dp=1, rank=0, pp_rank=0, dp_rank=0, device=torch.device("cpu"))
    assert one.order == ("pp", "dp", "tp")
    assert [mesh.coordinates(r, dp=3, tp=2) for r in range(12)] == GRID_2x3x2[MESH_DIMS]


def test_a_rank_finds_its_pipeline_peers_through_the_mesh_order() -> None:
    order, cpu = ("dp", "pp", "tp"), torch.device("cpu")
    me = mesh.Mesh(pp=2, dp=2, rank=1, pp_rank=0, dp_rank=1, order=order, device=cpu)
    assert [me.global_rank(pp_rank=p) for p in range(2)] == [2, 3]


def test_the_flag_reads_the_order_outermost_first_and_round_trips() -> None:
    config = TrainConfig.of(dp=2, mesh_order="dp, pp,tp")
    assert config.parallel.mesh_order == ("dp", "pp", "tp")
    assert config.flat()["mesh_order"] == "dp,pp,tp"


@pytest.mark.parametrize("order", ["pp,dp", "pp,dp,dp", "pp,dp,tp,ep", "pipe,data,tensor", ""])
def test_an_order_that_is_not_a_permutation_is_refused_with_the_fix(order: str) -> None:
    with pytest.raises(ValueError, match=r"not an order of the dimensions pp, dp and tp.*pp,dp,tp"):
        ParallelConfig(mesh_order=order)  # type: ignore[arg-type]


def test_meshpipe_train_refuses_a_bad_order_before_starting_ranks(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, message = cli_error(["train", "--model", "gpt-tiny", "--mesh-order", "tp,pp"], capsys)
    assert code == 2
    assert "mesh_order='tp,pp' is not an order of the dimensions" in message
