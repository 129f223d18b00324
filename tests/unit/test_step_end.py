"""What follows a step's schedule on a rank (`engine.runtime.step_end.StepEnd`): when the step
waits for the pipeline's gradient norm, when gradients are summed over replicas, when tied
weights are summed first, and the optimizer step."""

from types import SimpleNamespace
from typing import Any

import torch

from engine.config import EngineOptions, ReplicaSync
from engine.runtime.precision import LossScaler
from engine.runtime.step_end import StepEnd

_QUIET = EngineOptions(nonfinite_guard=False)
"""No clipping, fp32, no non-finite guard: nothing asks for the pipeline's gradient norm."""


def _end(**given: Any) -> StepEnd:
    """A step end of one rank, without replicas, ties, ZeRO or an optimizer unless given."""
    fields: dict[str, Any] = {
        "mesh": SimpleNamespace(dp=1),
        "options": _QUIET,
        "timeout_s": 5.0,
        "dp_reduce": None,
        "sharded": None,
        "ties": SimpleNamespace(groups={}),
        "gradients": None,
        "optimizer": None,
        "param_server": None,
        "meetings": None,
        "replicas": None,
        "replica_sync": ReplicaSync(),
        "scaler": None,
    }
    return StepEnd(**(fields | given))


def test_steps_synchronise_only_when_a_norm_or_a_verdict_is_needed() -> None:
    assert not _end().synchronises_steps
    assert _end(options=EngineOptions(nonfinite_guard=False, clip_grad_norm=1.0)).synchronises_steps
    assert _end(options=EngineOptions(nonfinite_guard=False, precision="fp16")).synchronises_steps
    assert _end(options=EngineOptions()).synchronises_steps  # the guard is on by default


def test_an_unsynchronised_step_has_no_norm_and_never_skips() -> None:
    assert _end().check_gradients(loss=float("nan")) == (None, False)


def test_gradients_are_summed_over_replicas_that_step_together() -> None:
    assert not _end().sums_over_replicas
    assert _end(mesh=SimpleNamespace(dp=2)).sums_over_replicas
    alone = ReplicaSync(dp_sync="local-sgd", sync_every=4)
    assert not _end(mesh=SimpleNamespace(dp=2), replica_sync=alone).sums_over_replicas
    assert _end(replicas=object()).sums_over_replicas  # a fault-tolerant quorum, dp 1 inside


def test_only_zero2_sums_tied_weights_before_its_reduction() -> None:
    tied = SimpleNamespace(groups={"wte": None})
    assert _end(sharded=SimpleNamespace(level=2), ties=tied).ties_before_reduction
    assert not _end(sharded=SimpleNamespace(level=1), ties=tied).ties_before_reduction
    assert not _end(sharded=SimpleNamespace(level=2)).ties_before_reduction
    assert not _end(ties=tied).ties_before_reduction


def _weight() -> tuple[torch.nn.Parameter, torch.optim.Optimizer]:
    weight = torch.nn.Parameter(torch.ones(3))
    weight.grad = torch.ones(3)
    return weight, torch.optim.SGD([weight], lr=0.5)


def test_the_optimizer_steps_unless_the_step_is_skipped() -> None:
    weight, optimizer = _weight()
    end = _end(optimizer=optimizer)
    assert end.optimizer_step(skipped=True) == 1.0
    assert torch.equal(weight.detach(), torch.ones(3))
    assert end.optimizer_step(skipped=False) == 1.0
    assert torch.equal(weight.detach(), torch.full((3,), 0.5))


def test_the_step_reports_the_loss_scale_it_used_and_then_updates_it() -> None:
    _, optimizer = _weight()
    scaler = LossScaler(scale=1024.0, hysteresis=1)
    end = _end(optimizer=optimizer, scaler=scaler)
    assert end.optimizer_step(skipped=True) == 1024.0
    assert scaler.scale == 512.0  # an overflow halves it for the next step
