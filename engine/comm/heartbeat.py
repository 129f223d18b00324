"""Heartbeats: how the launcher tells the rank that stopped from the ranks that waited for it.

When one rank stalls (SIGSTOP, a hung driver call, a swapped-out host) its peers fail on their
own timeouts saying "a peer crashed": every error names a victim, none the culprit. So each
locally launched rank keeps a small record in the launcher's folder (`HEARTBEAT_DIR_ENV`): its
coordinates, the step and action (or collective) it is in, rewritten every `BEAT_S` seconds by
a daemon thread. A stalled process's thread stops too, so once a peer has failed, a record
gone stale names the rank that stopped and what it was doing (`stalled`); the launcher then
kills it rather than waiting out its SIGTERM grace (a stopped process never handles SIGTERM).

The rank's main thread only assigns a string per action (`doing`), so the cost is a
reference store per action and one small file write per beat.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "BEAT_S",
    "HEARTBEAT_DIR_ENV",
    "Beat",
    "Heartbeat",
    "doing",
    "note",
    "read_beats",
    "stalled",
    "step_begins",
]

HEARTBEAT_DIR_ENV = "MESHPIPE_HEARTBEAT_DIR"
"""Set by `launch_local` for its ranks: the folder their records go to."""

BEAT_S = 0.25
"""Seconds between two writes of a rank's record."""

_state: dict[str, Any] = {"step": None, "doing": "starting"}
"""What this process is doing, as the main thread last said (read by the beating thread)."""


def step_begins(step: int) -> None:
    """Note that optimizer step `step` (0-based) begins on this rank."""
    _state["step"] = step


def note(what: str) -> None:
    """Note `what` as this rank's activity from now on (the interpreter, once per action)."""
    _state["doing"] = what


@contextlib.contextmanager
def doing(what: str) -> Iterator[None]:
    """Note `what` (an action, a collective) as this rank's activity while the block runs."""
    before = _state["doing"]
    _state["doing"] = what
    try:
        yield
    finally:
        _state["doing"] = before


@dataclass(frozen=True, kw_only=True)
class Beat:
    """One rank's record, as the launcher reads it."""

    rank: int
    where: str
    """Its place in the mesh, such as "pipeline stage 1 of 2, dp replica 0"."""
    pid: int
    attempt: int
    """The launcher's restart count when it was written."""
    step: int | None
    doing: str
    state: str
    """"running", or "failed" / "done" once its process ends."""
    at: float
    """time.time() of the write."""
    error: str = ""
    """"KindError: message" of the exception that ended a failed rank."""

    def describe(self, now: float) -> str:
        """ "rank 1 (…) stopped responding 6.1 s ago at step 3, during …"."""
        at_step = "" if self.step is None else f" at step {self.step + 1}"
        return (
            f"rank {self.rank} ({self.where}) stopped responding {now - self.at:.1f} s ago"
            f"{at_step}, during {self.doing}"
        )


class Heartbeat:
    """This rank's record in `folder`, rewritten every `BEAT_S` s from a daemon thread;
    a context manager: on exit the record says "done" or "failed"."""

    def __init__(self, folder: str | os.PathLike[str], *, rank: int, where: str) -> None:
        self._path = Path(folder) / f"rank-{rank:05d}.json"
        self._fields = {
            "rank": rank,
            "where": where,
            "pid": os.getpid(),
            "attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
        }
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="meshpipe-heartbeat", daemon=True)

    def __enter__(self) -> Heartbeat:
        self._write("running")
        self._thread.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, *_: object
    ) -> None:
        self._stop.set()
        self._thread.join()
        if kind is None:
            self._write("done")
        else:  # said here: a peer stalled in a collective may hold this process's exit
            self._write("failed", error=f"{kind.__name__}: {error}")

    def _beat(self) -> None:
        while not self._stop.wait(BEAT_S):
            self._write("running")

    def _write(self, state: str, *, error: str = "") -> None:
        record = {**self._fields, **_state, "state": state, "at": time.time(), "error": error}
        temporary = self._path.with_suffix(".tmp")
        try:
            temporary.write_text(json.dumps(record), encoding="utf-8")
            os.replace(temporary, self._path)
        except OSError:
            pass  # a full disk must not kill the rank: the launcher then just knows less


def read_beats(folder: str | os.PathLike[str]) -> list[Beat]:
    """Every readable record in `folder`, of the newest launch attempt only."""
    beats = []
    for path in sorted(Path(folder).glob("rank-*.json")):
        try:
            beats.append(Beat(**json.loads(path.read_text(encoding="utf-8"))))
        except (OSError, ValueError, TypeError):
            continue  # being replaced right now, or not ours
    newest = max((beat.attempt for beat in beats), default=0)
    return [beat for beat in beats if beat.attempt == newest]


def stalled(beats: list[Beat], *, now: float, stale_s: float) -> list[Beat]:
    """The running ranks whose record is older than `stale_s`. Only once a peer has failed
    is that a verdict; before, a slow beat may be a busy host."""
    return [beat for beat in beats if beat.state == "running" and now - beat.at > stale_s]
