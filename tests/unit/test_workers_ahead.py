"""Work handed to the worker processes ahead and collected as it is asked for
(`engine.memory.workers.Ahead`), and workers prepared as they start (`kept_workers`)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from engine.memory.trace_store import forget_traces, trace_ahead
from engine.memory.workers import Ahead, in_workers, kept_workers
from tests.unit.test_trace_ahead import _requests

_PREPARED: list[int] = []


def _prepare() -> None:
    _PREPARED.append(os.getpid())


def _prepared(_: int) -> list[int]:
    return list(_PREPARED)


def _square(n: int) -> int:
    return n * n


@pytest.fixture
def two_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MESHPIPE_TRACE_WORKERS", "2")
    monkeypatch.setenv("MESHPIPE_TRACE_CACHE", "off")


def test_kept_workers_are_prepared_as_they_start(two_workers: None) -> None:
    with kept_workers(_prepare):
        seen = list(in_workers(_prepared, range(8)))
    assert _PREPARED == []  # not here
    assert all(len(prepared) == 1 and prepared[0] != os.getpid() for prepared in seen)


def test_ahead_collects_in_the_order_handed_over_up_to_the_item_asked_for(
    two_workers: None,
) -> None:
    ahead: Ahead[int, int] = Ahead(_square)
    with kept_workers():
        assert ahead.start([5, 3, 7, 2])
        assert list(ahead.collect(3)) == [(5, 25), (3, 9)]
        assert ahead.waiting(7) and not ahead.waiting(3)
        assert list(ahead.collect(3)) == []  # collected already
        assert list(ahead.collect()) == [(7, 49), (2, 4)]
        assert not ahead.waiting(2)


def _slow_mark(path: str) -> None:
    time.sleep(0.05)
    Path(path).touch()


def test_ahead_stopped_cancels_what_has_not_started(two_workers: None, tmp_path: Path) -> None:
    """The workers are wanted for other work: what they hold and have not begun is dropped,
    even where nothing was collected yet."""
    ahead: Ahead[str, None] = Ahead(_slow_mark)
    with kept_workers():
        ahead.start([str(tmp_path / str(i)) for i in range(40)])
        ahead.stop()
        assert not ahead.waiting(str(tmp_path / "39"))
        assert list(ahead.collect()) == []
    assert len(list(tmp_path.iterdir())) < 10


def test_ahead_without_workers_hands_nothing_over(monkeypatch: pytest.MonkeyPatch) -> None:
    """One worker (or one item): the caller works each item out itself when it needs it."""
    monkeypatch.setenv("MESHPIPE_TRACE_WORKERS", "1")
    ahead: Ahead[int, int] = Ahead(_square)
    assert not ahead.start([1, 2, 3])
    assert not ahead.waiting(1)


def test_traces_are_handed_over_before_more_work_is_queued_behind_them(
    two_workers: None,
) -> None:
    """`trace_ahead`'s `meanwhile` runs once the traces are with the workers, before any is
    waited for: the search queues its schedule counts behind them so."""
    forget_traces()
    calls: list[str] = []
    with kept_workers():
        trace_ahead(
            _requests(),
            progress=lambda done, total: calls.append("traced"),
            meanwhile=lambda: calls.append("meanwhile"),
        )
    assert calls[0] == "meanwhile" and calls.count("traced") == len(calls) - 1 > 0
