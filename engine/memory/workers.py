"""Independent pure work spread over forked worker processes: a first search's traces
(`engine.memory.trace_store.trace_ahead`) and schedule counts (`engine.plan.context`).

Workers are forked, so they start with the caller's imports and state; not off Linux, nor
from a process in a process group (a child would share its sockets). Inside `kept_workers`
the workers a first call starts serve every later call: a worker's first trace imports
`torch._dynamo` (about 1.3 s of CPU), which a search's stage traces would otherwise pay
again in new workers.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import sys
from collections.abc import Callable, Generator, Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import TypeVar

import torch.distributed as dist

from engine.config import require

__all__ = ["in_workers", "kept_workers", "submitted", "worker_count"]

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
def kept_workers() -> Iterator[None]:
    """Within it, `in_workers` keeps the workers it starts for the next call, and they are
    shut down at its end: for a run that hands them work in several rounds (a search)."""
    if _Kept.active:
        yield
        return
    _Kept.active = True
    try:
        yield
    finally:
        pool, _Kept.pool, _Kept.active = _Kept.pool, None, False
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)


def _pool(workers: int) -> ProcessPoolExecutor:
    return ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork"))


def in_workers(work: Callable[[_In], _Out], items: Sequence[_In]) -> Generator[_Out, None, None]:
    """`work` of each item, in order: in forked workers where there are cores and more than
    one item, else here in turn. Items not started are cancelled if the caller stops (an
    error, Ctrl-C) instead of run to the end. A worker that dies raises `BrokenProcessPool`
    (and, inside `kept_workers`, the next call starts new workers)."""
    workers = min(len(items), worker_count())
    if workers <= 1:
        yield from map(work, items)
        return
    if not _Kept.active:
        pool = _pool(workers)
        try:
            yield from pool.map(work, items)
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
        return
    kept = _kept_pool()
    try:
        yield from kept.map(work, items)
    except BrokenProcessPool:
        _discard(kept)
        raise


def submitted(work: Callable[[_In], _Out], items: Sequence[_In]) -> list[Future[_Out]] | None:
    """Inside `kept_workers`, with cores to spare: `work` of each item handed to the kept
    workers now, in order, and each result to take when it is wanted, so the caller works on
    beside them (cancel those it never wants). Else None: the caller works them itself."""
    if not _Kept.active or worker_count() <= 1 or not items:
        return None
    kept = _kept_pool()
    try:
        return [kept.submit(work, item) for item in items]
    except BrokenProcessPool:
        _discard(kept)
        return None


def _kept_pool() -> ProcessPoolExecutor:
    """The pool `kept_workers` holds, started on first use."""
    _Kept.pool = _Kept.pool or _pool(worker_count())
    return _Kept.pool


def _discard(kept: ProcessPoolExecutor) -> None:
    """A kept pool a worker died in: shut down, so the next call starts new workers."""
    kept.shutdown(wait=False, cancel_futures=True)
    _Kept.pool = None
