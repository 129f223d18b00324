"""A search's schedule counts (`engine.plan.counts`) by schedule: held, kept on disk beside
the traces (`engine.memory.trace_cache`: they follow from the code alone, and counting a 405b
search's schedules takes seconds), and counted ahead in the worker processes, as the
compiled programs are (`engine.plan.programs`).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterable
from concurrent.futures import CancelledError, Future
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass

from engine.memory.trace_cache import load_payload, store_payload, trace_key
from engine.memory.workers import in_workers, submitted
from engine.plan.counts import StageCounts, counts_from_payload, counts_payload

__all__ = ["CountKey", "CountStore"]

CountKey = tuple[str, int, int, int]
"""A schedule whose in-flight counts the search reads: (name, pp, micro-batches, v)."""

Report = Callable[[int, int], None]


@dataclass
class _Taking:
    """The counts `CountStore.ahead` handed to the workers: how many, how many taken so far,
    and whom to tell."""

    progress: Report | None = None
    total: int = 0
    done: int = 0


class CountStore:
    """Counts by key: held, else handed to the workers (then waited for), else on disk, else
    counted here. `in_worker` counts one key in a worker process (a module-level function)."""

    def __init__(self, in_worker: Callable[[CountKey], StageCounts]) -> None:
        self._in_worker = in_worker
        self._counted: dict[CountKey, StageCounts] = {}
        self._coming: dict[CountKey, Future[StageCounts]] = {}
        """Counts handed to the workers, not yet taken (`ahead`)."""
        self._taking = _Taking()

    def get(self, key: CountKey, count: Callable[[], StageCounts]) -> StageCounts:
        """The key's counts: known (`known`), else `count()`ed here and kept. A stored
        payload that does not read back is counted again."""
        known = self.known(key)
        if known is None:
            known = count()
            self._keep(key, known)
        return known

    def known(self, key: CountKey) -> StageCounts | None:
        """The counts this search holds, or is counting in its workers (then waited for), or
        the disk has (then held from now on), else None."""
        known = self._counted.get(key)
        if known is None and key in self._coming:
            return self._taken(key)
        if known is None:
            stored = load_payload(trace_key("stage_counts", *key), "counts")
            with contextlib.suppress(KeyError, TypeError, ValueError):
                known = None if stored is None else counts_from_payload(stored)
            if known is not None:
                self._counted[key] = known
        return known

    def _taken(self, key: CountKey) -> StageCounts | None:
        """A count coming from the workers, waited for and kept; None where a worker died
        (out of memory?) or it was cancelled: `get` counts it here."""
        try:
            made = self._coming.pop(key).result()
        except (BrokenProcessPool, CancelledError):
            return None
        self._counted[key] = made  # written to disk by the worker (`_stored`)
        self._taking.done += 1
        if self._taking.progress is not None:
            self._taking.progress(self._taking.done, self._taking.total)
        return made

    def _keep(self, key: CountKey, counts: StageCounts) -> None:
        """Counts just made here: held by this search and written to the disk cache."""
        self._counted[key] = counts
        _store(key, counts)

    def ahead(self, keys: Iterable[CountKey], progress: Report | None = None) -> None:
        """Count the schedules of `keys` neither held, coming nor on disk, in worker processes
        where the machine has the cores (`engine.memory.workers`): a first 405b search counts
        hundreds of schedules of up to 100k actions, each on its own. Inside `kept_workers`
        (a search) they are handed to its workers in the order of `keys` and taken as `get`
        asks for them, so the screen runs beside the counting (`stop` after it);
        `progress(done, total)` as each is taken. Elsewhere, counted at once, longest first."""
        wanted = dict.fromkeys(k for k in keys if k not in self._coming)
        missing = [key for key in wanted if self.known(key) is None]
        in_worker = functools.partial(_stored, self._in_worker)
        coming = submitted(in_worker, missing)
        if coming is not None:
            self._coming.update(zip(missing, coming, strict=True))
            self._taking = _Taking(progress=progress, total=len(self._coming))
            return
        missing.sort(key=lambda k: k[1] * k[2] * k[3], reverse=True)
        try:
            made = zip(missing, in_workers(in_worker, missing), strict=True)
            for done, (key, counts) in enumerate(made, start=1):
                self._counted[key] = counts
                if progress is not None:
                    progress(done, len(missing))
        except BrokenProcessPool:
            return  # a worker died (out of memory?): `get` counts the rest here, when asked

    def stop(self) -> None:
        """Cancel the counts handed to the workers and never asked for (the workers are
        wanted for other work), and report the counting done."""
        for coming in self._coming.values():
            coming.cancel()
        self._coming.clear()
        if self._taking.progress is not None and self._taking.total:
            self._taking.progress(self._taking.total, self._taking.total)
        self._taking = _Taking()


def _store(key: CountKey, counts: StageCounts) -> None:
    store_payload(trace_key("stage_counts", *key), "counts", counts_payload(counts))


def _stored(count: Callable[[CountKey], StageCounts], key: CountKey) -> StageCounts:
    """One key's counts, counted and written to the disk cache by the worker that counts
    them: encoding and writing a 405b search's counts took the search's own process 0.7 s
    while the screen waited on it."""
    counts = count(key)
    _store(key, counts)
    return counts
