"""Independent pure work spread over forked worker processes: a first search's traces
(`engine.memory.trace_store.trace_ahead`) and schedule counts (`engine.plan.context`).

Workers are forked, so they start with the caller's imports and state; not off Linux, nor
from a process in a process group (a child would share its sockets). Inside `kept_workers`
the workers a first call starts serve every later call: a worker's first trace imports
`torch._dynamo` (about 1.3 s of CPU), which a search's stage traces would otherwise pay
again in new workers; a search starts them as it begins, to import it while it lays out its
candidates (`kept_workers(prepare)`).
"""

from __future__ import annotations

import collections
import contextlib
import multiprocessing
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Generic, TypeVar

import torch.distributed as dist

from engine.config import require

__all__ = ["Ahead", "in_workers", "kept_workers", "worker_count"]

_In = TypeVar("_In")
_Out = TypeVar("_Out")

_MOST_WORKERS = 8
"""Workers started unless told otherwise: each forked worker comes to own a copy of the
pages of the search it touches, and a search rarely has more long pieces of work."""


def worker_count() -> int:
    """Worker processes to use: `MESHPIPE_TRACE_WORKERS`, else the cores this process may run
    on, at most `_MOST_WORKERS`; 1 (none) off Linux or inside a process group."""
    if sys.platform != "linux" or dist.is_initialized():
        return 1
    chosen = os.environ.get("MESHPIPE_TRACE_WORKERS")
    if chosen:
        require(
            chosen.isdigit() and int(chosen) >= 1,
            f"MESHPIPE_TRACE_WORKERS={chosen!r} is not a whole number of processes (1 or more; "
            "1 works in this process only)",
        )
        return int(chosen)
    return min(len(os.sched_getaffinity(0)), _MOST_WORKERS)


class _Kept:
    """The pool `kept_workers` holds open (None until a call needs workers)."""

    active = False
    pool: ProcessPoolExecutor | None = None


@contextlib.contextmanager
def kept_workers(prepare: Callable[[], object] | None = None) -> Iterator[None]:
    """Within it, `in_workers` keeps the workers it starts for the next call, and they are
    shut down at its end: for a run that hands them work in several rounds (a search).

    `prepare`: started in each worker at once, while the caller goes on (what their first
    piece of work would otherwise pay for first, an import)."""
    if _Kept.active:
        yield
        return
    _Kept.active = True
    try:
        if prepare is not None and worker_count() > 1:
            _Kept.pool = _pool(worker_count(), prepare)
            _Kept.pool.submit(int)  # forked workers start together on the first submission
        yield
    finally:
        pool, _Kept.pool, _Kept.active = _Kept.pool, None, False
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)


def _pool(workers: int, prepare: Callable[[], object] | None = None) -> ProcessPoolExecutor:
    return ProcessPoolExecutor(
        workers, mp_context=multiprocessing.get_context("fork"), initializer=prepare
    )


def in_workers(work: Callable[[_In], _Out], items: Sequence[_In]) -> Iterator[_Out]:
    """`work` of each item, in order: in forked workers where there are cores and more than
    one item, else here in turn (as each result is asked for). Workers are handed every item
    at once, before a result is asked for, behind what they were handed before: a caller may
    hand over several rounds and collect them later (`Ahead`). Items not started are
    cancelled if the caller stops (closes the iterator, or drops it: an error, Ctrl-C)
    instead of run to the end. A worker that dies raises `BrokenProcessPool` (and, inside
    `kept_workers`, the next call starts new workers)."""
    workers = min(len(items), worker_count())
    if workers <= 1:
        return map(work, items)
    if not _Kept.active:
        pool = _pool(workers)
        return _Results([pool.submit(work, item) for item in items], pool, owned=True)
    kept = _Kept.pool = _Kept.pool or _pool(worker_count())
    return _Results([kept.submit(work, item) for item in items], kept, owned=False)


class _Results(Iterator[_Out]):
    """Submitted work's results in order; closing cancels what has not started, and shuts
    down a pool of its own (a kept pool serves the next round)."""

    def __init__(self, futures: list[Future[_Out]], pool: ProcessPoolExecutor, *, owned: bool):
        self._futures = collections.deque(futures)
        self._pool: ProcessPoolExecutor | None = pool
        self._owned = owned

    def __next__(self) -> _Out:
        if not self._futures:
            self.close()
            raise StopIteration
        try:
            return self._futures.popleft().result()
        except BrokenProcessPool:
            if not self._owned:
                assert self._pool is not None
                self._pool.shutdown(wait=False, cancel_futures=True)
                if _Kept.pool is self._pool:
                    _Kept.pool = None
            self.close()
            raise

    def close(self) -> None:
        for future in self._futures:
            future.cancel()
        self._futures.clear()
        pool, self._pool = self._pool, None
        if pool is not None and self._owned:
            pool.shutdown(wait=True, cancel_futures=True)

    def __del__(self) -> None:
        self.close()


class Ahead(Generic[_In, _Out]):
    """Work handed to the workers in one order and collected in that order as it is asked
    for, while the caller goes on with other work: where there are no workers to spare,
    nothing is handed over and the caller works each item out itself when it needs it."""

    def __init__(self, work: Callable[[_In], _Out]) -> None:
        self._work = work
        self._order: collections.deque[_In] = collections.deque()
        self._waiting: set[_In] = set()
        self._coming: Iterator[_Out] | None = None

    def start(self, items: Sequence[_In]) -> bool:
        """Hand `items` to the workers (an earlier start's items not begun are cancelled);
        False where there are no workers to spare (nothing handed over)."""
        self.stop()
        if worker_count() <= 1 or len(items) < 2:
            return False
        self._order.extend(items)
        self._waiting.update(items)
        self._coming = in_workers(self._work, items)
        return True

    def waiting(self, item: _In) -> bool:
        """Whether `item` was handed over and is not collected yet."""
        return item in self._waiting

    def collect(self, until: _In | None = None) -> Iterator[tuple[_In, _Out]]:
        """The results in the order handed over, up to `until`'s (every one where None);
        none more once a worker died (the caller works the rest out itself)."""
        while self._order and (until is None or until in self._waiting):
            assert self._coming is not None
            try:
                result = next(self._coming)
            except (StopIteration, BrokenProcessPool):
                self.stop()
                return
            item = self._order.popleft()
            self._waiting.discard(item)
            yield item, result

    def stop(self) -> None:
        """Cancel the items not begun (the workers are wanted for other work)."""
        coming, self._coming = self._coming, None
        self._order.clear()
        self._waiting.clear()
        if isinstance(coming, _Results):
            coming.close()
