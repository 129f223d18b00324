"""Traces made ahead in worker processes (`engine.memory.traces.trace_ahead`): the same traces,
made once, handed to the process that asked, and nothing forked where it would not pay."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest

from engine.memory.fitting import layer_requests
from engine.memory.replay import StageShape
from engine.memory.traces import TraceRequest, cached_trace, forget_traces, trace_ahead
from engine.runtime.stage import StageError
from models import layer_specs

_traces = sys.modules[cached_trace.__module__]


def _requests(tp: int = 1) -> list[TraceRequest]:
    """gpt-tiny's distinct layers alone, as the planner's screen traces them."""
    shape = StageShape(
        micro_batches=1,
        micro_batch_size=1,
        seq_len=8,
        hidden=64,
        divisor=1,
        precision="bf16",
        recompute="none",
        tp=tp,
    )
    return layer_requests(tuple(layer_specs("gpt-tiny")), shape, "cpu", (False,))


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No trace held in this process or on disk, and two workers whatever the machine."""
    monkeypatch.setenv("MESHPIPE_TRACE_CACHE", "off")
    monkeypatch.setenv("MESHPIPE_TRACE_WORKERS", "2")
    forget_traces()
    yield
    forget_traces()


def _refuse_tracing_here(monkeypatch: pytest.MonkeyPatch) -> None:
    def refused(*args: object, **kwargs: object) -> None:
        raise AssertionError("traced in the asking process")

    monkeypatch.setattr(_traces, "trace_stage", refused)


def test_traces_made_by_workers_equal_those_made_here_and_are_not_made_again(
    fresh: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    requests = _requests(tp=2)
    here = [cached_trace(*r) for r in requests]
    forget_traces()
    trace_ahead(requests)
    _refuse_tracing_here(monkeypatch)
    assert [cached_trace(*r) for r in requests] == here


def test_traces_held_already_fork_no_workers(fresh: None, monkeypatch: pytest.MonkeyPatch) -> None:
    requests = _requests()
    for r in requests:
        cached_trace(*r)

    def no_pool(*args: object, **kwargs: object) -> None:
        raise AssertionError("a worker pool for traces already held")

    monkeypatch.setattr(_traces, "ProcessPoolExecutor", no_pool)
    trace_ahead(requests + requests)


def test_one_worker_leaves_the_tracing_to_the_asking_process(
    fresh: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MESHPIPE_TRACE_WORKERS", "1")
    made: list[object] = []
    real = _traces.trace_stage

    def recording(*args: object, **kwargs: object) -> object:
        made.append(real(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(_traces, "trace_stage", recording)
    requests = _requests()
    trace_ahead(requests)
    assert not made
    traced = [cached_trace(*r) for r in dict.fromkeys(requests)]
    assert made == traced


def test_a_workers_error_reaches_the_asking_process(fresh: None) -> None:
    """gpt-tiny's 4 heads do not split 3 ways: the worker's own error, raised here."""
    with pytest.raises(StageError, match="failed on micro-batch 0"):
        trace_ahead(_requests(tp=3))


def test_a_worker_count_that_is_not_a_number_is_refused_by_name(
    fresh: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MESHPIPE_TRACE_WORKERS", "many")
    with pytest.raises(ValueError, match="MESHPIPE_TRACE_WORKERS='many'"):
        trace_ahead(_requests())
