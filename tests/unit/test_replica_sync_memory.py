"""`meshpipe memory` counts what --dp-sync keeps beside a replica's states: DiLoCo's weights of
the last meeting and outer momentum, the parameter server's masters and optimizer, checked
against the tensors the real `ReplicaMeetings` and `ParameterServer` hold for each stage."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

from engine.config import OptimizerSpec, ReplicaSync
from engine.memory.estimate import MemoryConfig, estimate_memory, resolve
from engine.memory.replay import build_stage
from engine.parallel import ParameterServer, ReplicaMeetings
from engine.runtime.optim import build_from_spec

LAYOUT: dict[str, Any] = {"model": "gpt-tiny", "pp": 2, "dp": 2, "device": "cpu", "seq_len": 16}


def _stages(config: MemoryConfig) -> list[torch.nn.Module]:
    """Each stage of the estimate's partition, built with real (uninitialised) CPU tensors."""
    layout = resolve(config)
    stages = []
    for s in range(layout.partition.num_stages):
        module = build_stage(layout.stage_specs(s)).to_empty(device="cpu")
        for param in module.parameters():
            param.grad = torch.ones_like(param)
        stages.append(module)
    return stages


def _nbytes(tensors: Iterator[torch.Tensor] | list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.fixture
def one_rank() -> Iterator[None]:
    """A one-process gloo world: a meeting of one replica all-reduces with itself."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("momentum", [0.9, 0.0])
def test_diloco_copies_are_the_meetings_tensors(one_rank: None, momentum: float) -> None:
    config = MemoryConfig.of(**LAYOUT, dp_sync="diloco", outer_momentum=momentum)
    report = estimate_memory(config)
    for module, stage in zip(_stages(config), report.stages, strict=True):
        meetings = ReplicaMeetings(list(module.parameters()), None, config.replica_sync, dp=1)
        meetings.meet()
        held = _nbytes(meetings.anchors) + _nbytes(meetings.momenta().values())
        assert stage.replica_copies == held == (8 if momentum else 4) * stage.parameters
        assert stage.peak == stage.weights + stage.optimizer + held + stage.step_peak


def test_the_parameter_server_keeps_masters_and_optimizer_on_its_rank() -> None:
    """After one update the server holds fp32 masters and AdamW's states: what the estimate
    counts as the stage's dp-sync copies and optimizer."""
    config = MemoryConfig.of(**LAYOUT, dp_sync="parameter-server")
    report = estimate_memory(config)
    for module, stage in zip(_stages(config), report.stages, strict=True):
        lead = build_from_spec(OptimizerSpec(), module)
        server = ParameterServer(
            list(module.parameters()),
            lead,
            dp_rank=0,
            dp=1,
            max_staleness=0,
            links={},
            timeout_s=10,
        )
        server.step(skipped=False)
        assert server.version == 1 and not lead.state  # the replica's own optimizer never steps
        assert stage.replica_copies == 4 * stage.parameters
        assert stage.replica_copies + stage.optimizer == server.server_bytes()


def test_every_step_and_local_sgd_keep_no_copies() -> None:
    for sync in ("every-step", "local-sgd"):
        report = estimate_memory(MemoryConfig.of(**LAYOUT, dp_sync=sync))
        assert all(stage.replica_copies == 0 for stage in report.stages)


def test_memory_refuses_what_training_refuses() -> None:
    with pytest.raises(ValueError, match=r"--dp-sync parameter-server with --zero 1"):
        MemoryConfig.of(**LAYOUT, dp_sync="parameter-server", zero=1)


def test_replica_sync_is_a_memory_setting() -> None:
    assert MemoryConfig.of(**LAYOUT, dp_sync="diloco").replica_sync == ReplicaSync(dp_sync="diloco")
