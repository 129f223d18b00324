"""A run's own action costs read back from its trace, and the step simulated with them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.config import ParallelConfig
from engine.plan import Hardware, PlanRequest, predict, step_with_costs
from engine.plan.candidates import Candidate
from engine.plan.request import Prediction
from engine.plan.run_costs import run_costs
from engine.plan.timing import StageTimes
from engine.schedule import ActionCosts, make_schedule, simulate

MS = 1000  # the trace's microseconds per millisecond


def _span(tid: int, name: str, cat: str, start_ms: float, ms: float) -> dict[str, object]:
    return {"ph": "X", "pid": 0, "tid": tid, "name": name, "cat": cat, "ts": start_ms * MS,
            "dur": ms * MS}  # fmt: skip


def _thread(tid: int, name: str) -> dict[str, object]:
    return {"ph": "M", "pid": 0, "tid": tid, "name": "thread_name", "args": {"name": name}}


def _trace(path: Path) -> Path:
    """Two ranks, two steps: stage 0 fused on rank 0, stage 1 split on rank 1; the first step
    (the warm-up) twice as slow; stage 0's forwards skewed (10, 12, 17 ms: median 12, mean 13)."""
    events = [_thread(0, "rank 0"), _thread(1, "rank 1"), _thread(2, "rank 0 communication")]
    events.append(_thread(3, "rank 1 communication"))
    for step, scale in ((0, 2.0), (1, 1.0)):
        t = 1000.0 * step
        events += [_span(0, "0F0", "F", t, 10 * scale), _span(0, "0B0", "B", t + 50, 20 * scale)]
        events += [_span(0, "0F1", "F", t + 80, 12 * scale), _span(0, "0F2", "F", t + 95, 17)]
        events += [_span(1, "1F0", "F", t + 20, 11 * scale), _span(1, "1I0", "I", t + 35, 9)]
        events += [_span(1, "1W0", "W", t + 45, 7 * scale)]
        events += [_span(2, "dp all-reduce", "dp all-reduce", t + 200, 4 * scale)]
        events += [_span(3, "tied sum", "tied sum", t + 200, 90)]  # mostly waiting
        events += [_span(0, "optimizer", "optimizer", t + 300, 5 * scale)]
        events += [_span(1, "optimizer", "optimizer", t + 300, 3 * scale)]
    path.write_text(json.dumps({"traceEvents": events}))
    return path


def test_a_runs_costs_are_its_steady_steps_means_per_stage(tmp_path: Path) -> None:
    stages, after = run_costs(_trace(tmp_path / "t.json"), placement=(0, 1))
    fused, split = stages
    assert (fused.forward, fused.backward) == pytest.approx((0.013, 0.020))  # a step pays all
    assert fused.input_grad == fused.backward and fused.weight_grad == 0.0
    assert (split.forward, split.input_grad, split.weight_grad) == pytest.approx(
        (0.011, 0.009, 0.007)
    )
    assert split.backward == pytest.approx(0.016)
    assert after == pytest.approx((0.005 + 0.004, 0.003))  # the tied sum's wait left out


_UNIT = StageTimes(
    forward=1.0, backward=2.0, input_grad=1.0, weight_grad=1.0, tp_comm=0.0, recompute=0.0
)


def _two_stage_1f1b(hardware: Hardware) -> tuple[PlanRequest, Prediction, float]:
    """gpt-tiny over two pipeline ranks, 1F1B of 8 micro-batches: the request, its plan, and
    the step `simulate` gives the schedule at unit costs (F 1, B 2)."""
    request = PlanRequest(
        model="gpt-tiny", devices=2, device_memory=2**30, global_batch=8, seq_len=32,
        hardware=hardware,
    )  # fmt: skip
    c = Candidate(
        mesh=ParallelConfig(pp=2, dp=1, tp=1),
        schedule="1f1b",
        stages_per_rank=1,
        micro_batches=8,
        micro_batch_size=1,
    )
    expected = simulate(make_schedule("1f1b", num_ranks=2, micro_batches=8), ActionCosts())
    return request, predict(request, c), expected.step_time


def test_the_step_with_given_costs_is_the_simulators_for_the_schedule() -> None:
    request, plan, step = _two_stage_1f1b(Hardware(link_bandwidth=1e30, latency=0.0))
    assert step_with_costs(request, plan, (_UNIT, _UNIT), (0.0, 0.0)) == pytest.approx(step)
    assert step_with_costs(request, plan, (_UNIT, _UNIT), (5.0, 0.0)) == pytest.approx(
        step + 5.0  # rank 0 ends last in 1F1B
    )


def test_a_runs_own_costs_are_simulated_on_a_core_each_where_its_ranks_shared_the_host() -> None:
    """The traced action times of ranks that shared one core already ran slower for it."""
    shared = Hardware(link_bandwidth=1e30, latency=0.0, host_cores=1)
    request, plan, step = _two_stage_1f1b(shared)
    assert step_with_costs(request, plan, (_UNIT, _UNIT), (0.0, 0.0)) == pytest.approx(step)
