"""Traces made ahead in worker processes (`engine.memory.trace_store.trace_ahead`): the same traces,
made once, handed to the process that asked, and nothing forked where it would not pay."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import replace
from multiprocessing.context import BaseContext

import pytest

import engine.memory.workers
from engine.memory.fitting import layer_requests
from engine.memory.replay import StageShape
from engine.memory.trace_store import TraceRequest, cached_trace, forget_traces, trace_ahead
from engine.memory.workers import in_workers, kept_workers
from engine.runtime.stage import StageError
from models import layer_specs

_traces = sys.modules[cached_trace.__module__]


_SHAPE = StageShape(
    micro_batches=1,
    micro_batch_size=1,
    seq_len=8,
    hidden=64,
    divisor=1,
    precision="bf16",
    recompute="none",
)


def _requests(tp: int = 1) -> list[TraceRequest]:
    """gpt-tiny's layers alone, as the planner's screen traces them."""
    shape = replace(_SHAPE, tp=tp)
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

    monkeypatch.setattr(engine.memory.workers, "ProcessPoolExecutor", no_pool)
    trace_ahead(requests + requests)


def test_one_worker_traces_in_the_asking_process_longest_first_reporting_each(
    fresh: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MESHPIPE_TRACE_WORKERS", "1")
    made: list[int] = []
    real = _traces.trace_stage

    def recording(specs: tuple[object, ...], **kwargs: object) -> object:
        made.append(len(specs))
        return real(specs, **kwargs)

    monkeypatch.setattr(_traces, "trace_stage", recording)
    whole = TraceRequest(tuple(layer_specs("gpt-tiny")), True, True, (False,), _SHAPE, "cpu")
    reports: list[tuple[int, int]] = []
    trace_ahead([*_requests(), whole], progress=lambda done, total: reports.append((done, total)))
    assert made == [7, 1, 1, 1, 1]  # the whole model first; its 4 blocks are one trace
    assert reports == [(0, 5), (1, 5), (2, 5), (3, 5), (4, 5), (5, 5)]
    _refuse_tracing_here(monkeypatch)
    assert cached_trace(*whole) is not None


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


def _pid(_: int) -> int:
    return os.getpid()


def _die(_: int) -> int:
    os._exit(1)


def _counting_pools(monkeypatch: pytest.MonkeyPatch) -> list[ProcessPoolExecutor]:
    """Every pool `in_workers` starts from now on."""
    started: list[ProcessPoolExecutor] = []

    def counted(workers: int, mp_context: BaseContext) -> ProcessPoolExecutor:
        started.append(ProcessPoolExecutor(workers, mp_context=mp_context))
        return started[-1]

    monkeypatch.setattr(engine.memory.workers, "ProcessPoolExecutor", counted)
    return started


def test_kept_workers_serve_every_round_and_stop_at_the_end(
    fresh: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A search's rounds (layer traces, counts, stage traces) share one pool, whose workers
    imported what their first trace needed; no worker outlives the search."""
    pools = _counting_pools(monkeypatch)
    with kept_workers():
        first = set(in_workers(_pid, range(8)))
        trace_ahead(_requests())
        second = set(in_workers(_pid, range(8)))
    assert len(pools) == 1
    assert len(first | second) <= 2
    assert os.getpid() not in first | second
    assert pools[0]._processes is None  # type: ignore[attr-defined]  # shut down


def test_without_kept_workers_each_round_starts_and_stops_its_own(
    fresh: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    pools = _counting_pools(monkeypatch)
    list(in_workers(_pid, range(4)))
    list(in_workers(_pid, range(4)))
    assert len(pools) == 2
    assert all(p._processes is None for p in pools)  # type: ignore[attr-defined]


def test_a_kept_pool_whose_worker_died_is_replaced_for_the_next_round(
    fresh: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    pools = _counting_pools(monkeypatch)
    with kept_workers():
        with pytest.raises(BrokenProcessPool):
            list(in_workers(_die, range(2)))
        assert os.getpid() not in set(in_workers(_pid, range(4)))
    assert len(pools) == 2
