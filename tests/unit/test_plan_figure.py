"""The plan's picture: its simulated step, every rank's tail included, above its peaks."""

from __future__ import annotations

from dataclasses import replace

import pytest

from engine.config import ParallelConfig
from engine.plan import Hardware, PlanRequest, Prediction, plan_figure, predict, search
from engine.plan.candidates import Candidate


@pytest.fixture(scope="module")
def request_and_plan() -> tuple[PlanRequest, Prediction]:
    request = PlanRequest(
        model="gpt-tiny", devices=4, device_memory=2**30, global_batch=8, seq_len=32, top=1
    )
    return request, search(request, timeline=True).plans[0]


def _rank_ends(plan: Prediction) -> list[float]:
    assert plan.simulated is not None
    return [max(t.end for t in row) for row in plan.simulated.timeline]


def test_a_plans_timeline_and_each_ranks_tail_end_at_its_step(
    request_and_plan: tuple[PlanRequest, Prediction],
) -> None:
    """The tail is each rank's dp reduction and optimizer update after its last action, what
    the step the search prints adds to the simulated schedule (not sampled here)."""
    _, plan = request_and_plan
    assert len(plan.tails) == len(_rank_ends(plan)) and any(plan.tails)
    ends = [end + tail for end, tail in zip(_rank_ends(plan), plan.tails, strict=True)]
    assert max(ends) == pytest.approx(plan.step_time, rel=1e-12)


def test_the_plans_figure_spans_the_whole_step_and_names_the_tail(
    request_and_plan: tuple[PlanRequest, Prediction],
) -> None:
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    request, plan = request_and_plan
    fig = plan_figure(request, plan)
    top = fig.axes[0]
    legend = [t.get_text() for t in top.get_legend().texts]
    plt.close(fig)
    assert top.get_xlim()[1] == pytest.approx(plan.step_time, rel=1e-12)
    assert legend[-1] == "dp reduction,\noptimizer" and legend[0] == "F"


def test_the_timeline_of_ranks_sharing_the_hosts_cores_ends_at_the_step_priced_so() -> None:
    """Four pipeline ranks on two cores (a CPU plan): the figure draws the shared clock the
    plan is priced by, not each rank on a core of its own."""
    cpu = Hardware(device_flops=1e9, host_cores=2)
    request = PlanRequest(
        model="gpt-tiny", devices=4, device_memory=2**30, global_batch=8, seq_len=32, hardware=cpu
    )
    layout = Candidate(
        mesh=ParallelConfig(pp=4, dp=1, tp=1),
        schedule="1f1b",
        stages_per_rank=1,
        micro_batches=8,
        micro_batch_size=1,
    )
    plan = predict(request, layout)
    own = predict(replace(request, hardware=replace(cpu, host_cores=0)), layout)
    assert plan.step_time > own.step_time
    ends = [end + tail for end, tail in zip(_rank_ends(plan), plan.tails, strict=True)]
    assert max(ends) == pytest.approx(plan.step_time, rel=1e-12)
