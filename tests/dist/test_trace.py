"""`--trace` of a 2-rank run opens cleanly in Perfetto: on every track slices nest (the dp
all-reduce, which overlaps the last backward, has a track of its own), and every slice says
which step it belongs to."""

from __future__ import annotations

import json
from collections import defaultdict
from typing import Any

import pytest

from engine.training.config import TrainConfig
from engine.training.data import prepare
from engine.training.loop import train
from tests.dist.harness import run_ranks

EPS_US = 1e-3
"""Rounding of microsecond sums: slices that touch may differ by this much."""


@pytest.fixture(scope="module")
def trace(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    folder = tmp_path_factory.mktemp("trace")
    (folder / "text.txt").write_text("a slice begins and ends inside its parent\n" * 200)
    data = str(prepare(folder / "text.txt", folder / "tokens").bin_path)
    run_ranks(_train, 2, data, str(folder / "t.json"))
    events: list[dict[str, Any]] = json.loads((folder / "t.json").read_text())["traceEvents"]
    return events


def _train(rank: int, world_size: int, data: str, path: str) -> None:
    config = TrainConfig.of(model="gpt-tiny", steps=2, global_batch=4, micro_batches=2,
                            seq_len=16, threads=1, dp=2, data=data, trace=path)  # fmt: skip
    train(config, progress=False)


def _crossing(slices: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """Pairs of slices on one track that overlap without one holding the other."""
    crossing: list[tuple[str, str]] = []
    stack: list[dict[str, Any]] = []
    for piece in sorted(slices, key=lambda e: (e["ts"], -e["dur"])):
        while stack and stack[-1]["ts"] + stack[-1]["dur"] <= piece["ts"] + EPS_US:
            stack.pop()
        if stack and piece["ts"] + piece["dur"] > stack[-1]["ts"] + stack[-1]["dur"] + EPS_US:
            crossing.append((stack[-1]["name"], piece["name"]))
        stack.append(piece)
    return crossing


def test_slices_nest_on_every_track(trace: list[dict[str, Any]]) -> None:
    tracks: dict[tuple[int, int], list[dict[str, Any]]] = defaultdict(list)
    for event in trace:
        if event["ph"] == "X":
            tracks[(event["pid"], event["tid"])].append(event)
    assert len(tracks) == 4  # two ranks, each with compute and communication
    assert {key: _crossing(slices) for key, slices in tracks.items()} == {k: [] for k in tracks}


def test_the_dp_all_reduce_runs_on_each_ranks_communication_track(
    trace: list[dict[str, Any]],
) -> None:
    names = {e["tid"]: e["args"]["name"] for e in trace if e["name"] == "thread_name"}
    reduces = [e for e in trace if e["ph"] == "X" and e["name"] == "dp all-reduce"]
    assert sorted(names[e["tid"]] for e in reduces) == [
        "rank 0 communication",
        "rank 0 communication",
        "rank 1 communication",
        "rank 1 communication",
    ]


def test_every_slice_carries_its_step(trace: list[dict[str, Any]]) -> None:
    slices = [e for e in trace if e["ph"] == "X"]
    assert all(isinstance(e["args"]["step"], int) for e in slices)
    per_step = {s: {e["name"] for e in slices if e["args"]["step"] == s} for s in (0, 1)}
    assert per_step[0] == per_step[1] and {"0F0", "0B1", "dp all-reduce"} <= per_step[0]
