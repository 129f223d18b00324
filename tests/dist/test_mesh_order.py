"""`--mesh-order` moves ranks, never results: the DeviceMesh groups hold the ranks `rank_of`
names; runs laid out in another order (pp 2 × dp 2 as dp,pp,tp, pp 2 × tp 2 as tp,pp,dp) give
the default order's losses bit for bit, in one launch, across two torchrun "nodes" on this host,
and when a checkpoint of one order resumes in another."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from engine.comm.launch import free_port
from engine.comm.mesh import init_mesh, rank_of
from engine.training.config import TrainConfig
from engine.training.data import prepare
from engine.training.loop import train
from tests.dist.harness import run_ranks

SETTINGS = {"model": "llama-tiny", "steps": 2, "global_batch": 8, "micro_batches": 2,
            "seq_len": 32, "threads": 1, "pp": 2, "dp": 2}  # fmt: skip


@pytest.fixture(scope="module")
def tokens(tmp_path_factory: pytest.TempPathFactory) -> str:
    folder = tmp_path_factory.mktemp("corpus")
    (folder / "text.txt").write_text("ranks move but the losses stay the same\n" * 300)
    return str(prepare(folder / "text.txt", folder / "tokens").bin_path)


def _groups(rank: int, world_size: int, order: str) -> dict[str, list[int]]:
    mesh = init_mesh(2, 2, timeout_s=30, device="cpu", order=order)
    expected_pp = [mesh.global_rank(pp_rank=p) for p in range(2)]
    expected_dp = [mesh.global_rank(pp_rank=mesh.pp_rank, dp_rank=d) for d in range(2)]
    groups = {name: dist.get_process_group_ranks(g) for name, g in
              (("pp", mesh.pp_group), ("dp", mesh.dp_group))}  # fmt: skip
    assert groups == {"pp": expected_pp, "dp": expected_dp}
    return groups


def test_dp_pp_tp_groups_hold_the_ranks_rank_of_names() -> None:
    groups = run_ranks(_groups, 4, "dp,pp,tp")
    at = {"tp_rank": 0, "dp": 2, "tp": 1, "pp": 2, "order": ("dp", "pp", "tp")}
    assert rank_of(pp_rank=1, dp_rank=0, **at) == 1
    assert [g["pp"] for g in groups] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [g["dp"] for g in groups] == [[0, 2], [1, 3], [0, 2], [1, 3]]


def _losses(
    rank: int, world_size: int, data: str, order: str, layout: dict[str, int]
) -> tuple[float, ...]:
    config = TrainConfig.of(**{**SETTINGS, **layout}, data=data, mesh_order=order)
    return train(config, progress=False).losses


@pytest.mark.parametrize(
    ("layout", "order"),
    [({"dp": 2}, "dp,pp,tp"), ({"dp": 1, "tp": 2}, "tp,pp,dp")],
    ids=["pp2-dp2-dp,pp,tp", "pp2-tp2-tp,pp,dp"],
)
def test_losses_in_another_order_equal_the_default_orders_bit_for_bit(
    tokens: str, layout: dict[str, int], order: str
) -> None:
    default = run_ranks(_losses, 4, tokens, "pp,dp,tp", layout)
    moved = run_ranks(_losses, 4, tokens, order, layout)
    assert len(set(default)) == 1 and len(set(moved)) == 1
    assert moved[0] == default[0]


def _flags(data: str) -> list[str]:
    values = {**SETTINGS, "data": data}
    return [arg for k, v in values.items() for arg in (f"--{k.replace('_', '-')}", str(v))]


def _losses_in(metrics: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]


def test_two_torchrun_nodes_with_a_non_default_order_equal_one_node(
    tokens: str, tmp_path: Path
) -> None:
    """Each "node" is its own torchrun with 2 local ranks; under dp,pp,tp node 0 holds the
    pipeline of replica 0 and node 1 that of replica 1, so only the dp sum crosses nodes."""
    port = str(free_port())
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "OMP_NUM_THREADS": "1"}
    train_args = ["-m", "engine.cli", "train", *_flags(tokens), "--no-progress", "--metrics-file"]
    nodes = [
        subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank",
             str(node), "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port",
             port, *train_args, str(tmp_path / "two.jsonl"), "--mesh-order", "dp,pp,tp"],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for node in range(2)
    ]
    outs = [node.communicate(timeout=300) for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], [err[-3000:] for _, err in outs]
    one_node = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
         "--master-port", str(free_port()), *train_args, str(tmp_path / "one.jsonl")],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert one_node.returncode == 0, one_node.stderr[-3000:]
    one, two = _losses_in(tmp_path / "one.jsonl"), _losses_in(tmp_path / "two.jsonl")
    assert len(one) == SETTINGS["steps"] and two == one


def _resumable(rank: int, world_size: int, config: TrainConfig) -> tuple[float, ...]:
    return train(config, progress=False).losses


def test_a_checkpoint_resumes_in_another_order_bit_for_bit(tokens: str, tmp_path: Path) -> None:
    """Checkpoints hold global names, so the order may change between runs like pp and dp;
    the RNG files, which are per rank, are restored only into the same order."""
    run = {**SETTINGS, "data": tokens, "save_every": 1}
    full = TrainConfig.of(**run, checkpoint_dir=str(tmp_path / "a"))
    losses = run_ranks(_resumable, 4, full)[0]
    layout = json.loads((tmp_path / "a" / "step-00000001" / "trainer.json").read_text())["layout"]
    assert layout["mesh_order"] == "pp,dp,tp"
    (tmp_path / "b").mkdir()
    shutil.copytree(tmp_path / "a" / "step-00000001", tmp_path / "b" / "step-00000001")
    (tmp_path / "b" / "latest").write_text("step-00000001\n")
    moved = TrainConfig.of(
        **run, checkpoint_dir=str(tmp_path / "b"), resume=True, mesh_order="dp,pp,tp"
    )
    assert run_ranks(_resumable, 4, moved) == [losses[1:]] * 4
