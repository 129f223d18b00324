"""The schedules a search simulates, compiled from their rows as arrays
(`engine.schedule.program.fused_program` of `generated_arrays.schedule_arrays`: what
`compiled_program` makes of the built schedule) in its worker processes ahead of the
simulations that run them.

A 405b search simulates about 190 layouts in the order of their lower bound, over some 50
distinct schedules. Building one (up to 64 ranks × 256 micro-batches) and compiling it to
integers took longer than simulating it, all in the search's own process while the workers
sat idle. The workers now compile them in the order the search will ask, and a program
crosses processes in a few hundredths of a second.
"""

from __future__ import annotations

from collections.abc import Generator, Iterable
from concurrent.futures.process import BrokenProcessPool

from engine.memory.workers import in_workers, worker_count
from engine.schedule import Program
from engine.schedule.generated_arrays import schedule_arrays
from engine.schedule.program import fused_program

__all__ = ["ProgramKey", "Programs"]

ProgramKey = tuple[str, int, int, int]
"""(schedule name, pipeline ranks, micro-batches, stages per rank)."""


def compile_key(key: ProgramKey) -> Program:
    """A generator's schedule compiled from its rows as arrays (in a worker): what
    `compiled_program` makes of it built."""
    return fused_program(schedule_arrays(*key))


class Programs:
    """Compiled schedules by key: compiled ahead in the workers (`ahead`), else here when
    asked for (`of`)."""

    def __init__(self) -> None:
        self._known: dict[ProgramKey, Program] = {}
        self._order: list[ProgramKey] = []
        self._coming: Generator[Program, None, None] | None = None

    def ahead(self, keys: Iterable[ProgramKey]) -> None:
        """Start compiling `keys` in the workers, in this order (the order they will be asked
        for); nothing where there are no workers to spare."""
        self.stop()
        missing = [key for key in dict.fromkeys(keys) if key not in self._known]
        if worker_count() <= 1 or len(missing) < 2:
            return
        self._order = missing[::-1]
        self._coming = in_workers(compile_key, missing)

    def stop(self) -> None:
        """Cancel what has not started (the workers are wanted for other work)."""
        coming, self._coming, self._order = self._coming, None, []
        if coming is not None:
            coming.close()

    def of(self, key: ProgramKey) -> Program:
        """The compiled schedule: waited for if it is coming, else compiled here."""
        while key not in self._known and key in self._order:
            assert self._coming is not None
            try:
                program = next(self._coming)
            except (StopIteration, BrokenProcessPool):
                self.stop()  # a worker died (out of memory?): compile the rest here
                break
            self._known[self._order.pop()] = program
        if key not in self._known:
            self._known[key] = compile_key(key)
        return self._known[key]
