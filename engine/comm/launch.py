"""Starting the ranks of a run: under a launcher, or our own local ones.

`meshpipe train --pp 2 --dp 2` started plainly on a laptop launches its own ranks through
torch's elastic agent (the machinery behind `torchrun`), so local runs take the same code path
as cluster runs.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import socket
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from engine.comm.heartbeat import BEAT_S, HEARTBEAT_DIR_ENV, Beat, read_beats, stalled

__all__ = ["RankFailed", "free_port", "is_launched", "launch_local", "names_a_value_error"]

T = TypeVar("T")


def is_launched() -> bool:
    """True under torchrun, the deepspeed launcher or our own agent (they all set these)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (for a rendezvous or a test's master)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class RankFailed(RuntimeError):
    """A local rank failed: the message is that rank's own error, where the agent's report
    would bury it under its tracebacks. `bad_input` when that error was a ValueError (a bad
    checkpoint, file or setting), which one process reports as bad input too."""

    def __init__(self, message: str, *, bad_input: bool = False) -> None:
        super().__init__(message)
        self.bad_input = bad_input


def _first_failure(error: ChildFailedError) -> RankFailed:
    rank, failure = error.get_first_failure()
    message = failure.message
    text = str(message.get("message", "")) if isinstance(message, dict) else str(message)
    where = f" (its traceback: {failure.error_file})" if os.path.isfile(failure.error_file) else ""
    kind = text.strip().split(":", 1)[0]  # the record reads "CheckpointError: …"
    return RankFailed(
        f"rank {rank} failed: {text.strip()}{where}", bad_input=names_a_value_error(kind)
    )


def names_a_value_error(name: str) -> bool:
    """Whether `name` is ValueError or a subclass loaded here (the rank runs the same code),
    known only by name from the rank's error record."""
    pending: list[type] = [ValueError]
    while pending:
        kind = pending.pop()
        if kind.__name__ == name:
            return True
        pending += kind.__subclasses__()
    return False


def _process_state(pid: int) -> str | None:
    """The kernel's one-letter state of child `pid` (R, S, T for stopped, Z…), None when it
    is gone or not this process's child (a pid reused since the record was written)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text(encoding="ascii")
        fields = stat.rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[0] if int(fields[1]) == os.getpid() else None


class _Watchdog:
    """Reads the ranks' heartbeats (`engine.comm.heartbeat`) while the agent runs. Once a
    rank has failed, a rank whose record went stale is the one the others waited for: it is
    named and SIGKILLed at once. A stopped process never acts on the agent's SIGTERM, and
    the failed peers' own exits may wait on it, so the agent alone would take 30 s more and
    then report the kill, not the wait: `verdict` says both."""

    def __init__(self, folder: str, *, stale_s: float) -> None:
        self._folder = folder
        self._stale_s = stale_s
        self._blamed: list[str] = []
        self._first = ""
        self._killed: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="meshpipe-watchdog", daemon=True)

    def __enter__(self) -> _Watchdog:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def verdict(self) -> str | None:
        """The ranks killed and what they were doing, then the first rank that gave up."""
        if not self._blamed:
            return None
        return (
            f"{'; '.join(self._blamed)}: killed once its peers gave up waiting for it "
            f"(the first, {self._first})"
        )

    def _watch(self) -> None:
        while not self._stop.wait(BEAT_S):
            beats = read_beats(self._folder)
            failed = sorted((b for b in beats if b.state == "failed"), key=lambda b: b.at)
            if failed:
                self._kill_stalled(beats, failed[0])

    def _kill_stalled(self, beats: list[Beat], first: Beat) -> None:
        now = time.time()
        for beat in stalled(beats, now=now, stale_s=self._stale_s):
            if beat.pid in self._killed or _process_state(beat.pid) in (None, "Z"):
                continue  # dead already: the agent reports its exit itself
            self._killed.add(beat.pid)
            self._blamed.append(beat.describe(now))
            self._first = self._first or f"rank {first.rank} failed: {first.error}"
            os.kill(beat.pid, signal.SIGKILL)


@contextlib.contextmanager
def _quiet_agent() -> Iterator[None]:
    """The agent logs each failed rank's traceback as errors, a Ctrl-C as a warning, and
    torch's process context each SIGTERM it sends; `RankFailed` and the CLI say each once.
    Its loggers carry their own levels, so each is set."""
    prefixes = ("torch.distributed.elastic", "torch.multiprocessing")
    known = logging.root.manager.loggerDict
    names = [*prefixes, *(n for n in known if n.startswith(tuple(p + "." for p in prefixes)))]
    loggers = [logging.getLogger(name) for name in names]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


_SHUTDOWN_GRACE_S = 5
"""Seconds the agent waits for ranks to end after a Ctrl-C or SIGTERM before SIGKILL."""


def launch_local(
    entrypoint: Callable[..., T],
    nproc: int,
    *args: Any,
    max_restarts: int = 0,
    stale_s: float = 3.0,
) -> dict[int, T]:
    """Run `entrypoint(*args)` on `nproc` local ranks; returns each rank's return value.

    Raises `RankFailed` with the first failed rank's error when a rank fails (after
    `max_restarts` restarts of all of them), and `KeyboardInterrupt` when the agent is
    interrupted (Ctrl-C, SIGTERM): it has stopped the ranks by then. A rank whose heartbeat
    is `stale_s` old once another failed is named and killed (`_Watchdog`). Everything the
    launch writes goes into one temporary folder, removed at the end unless the error names
    a traceback file in it."""
    log_dir = tempfile.mkdtemp(prefix="meshpipe-ranks-")
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"meshpipe-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{free_port()}",
        max_restarts=max_restarts,
        monitor_interval=0.2,
        start_method="spawn",
        logs_specs=DefaultLogsSpecs(log_dir=log_dir),
        shutdown_timeout=_SHUTDOWN_GRACE_S,
    )
    if max_restarts > 0:
        # The agent's shared TCPStore keeps the previous attempt's keys, so a restarted rank
        # may dial a dead peer's gloo address (pytorch/pytorch#135712): give each attempt a
        # store of its own, hosted by its rank 0.
        os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    watchdog = _Watchdog(log_dir, stale_s=stale_s)
    failure: RankFailed | None = None
    try:
        with _quiet_agent(), _launch_folder(log_dir), watchdog:
            return elastic_launch(config, entrypoint)(*args)
    except ChildFailedError as error:
        verdict = watchdog.verdict
        failure = RankFailed(verdict) if verdict else _first_failure(error)
        raise failure from None
    except SignalException as error:
        raise KeyboardInterrupt(str(error)) from None
    finally:
        _tidy(log_dir, keep=str(failure) if failure else "")


@contextlib.contextmanager
def _launch_folder(folder: str) -> Iterator[None]:
    """While the agent runs, its ranks' heartbeats and torch's per-process error files
    (`pytorch-errorfile-*.pickle`, made with `tempfile` by `torch.multiprocessing` and never
    removed) go into `folder`, and the resource tracker keeps its leak warnings to itself:
    a failed rank never releases its queue's semaphore, which the tracker then unlinks."""
    saved = {name: os.environ.get(name) for name in (HEARTBEAT_DIR_ENV, "PYTHONWARNINGS")}
    os.environ[HEARTBEAT_DIR_ENV] = folder
    os.environ["PYTHONWARNINGS"] = ",".join(
        filter(None, [saved["PYTHONWARNINGS"], "ignore:resource_tracker:UserWarning"])
    )
    previous, tempfile.tempdir = tempfile.tempdir, folder
    try:
        yield
    finally:
        tempfile.tempdir = previous
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _tidy(folder: str, *, keep: str) -> None:
    """Remove `folder`, or only what `keep` (the error shown) does not name in it."""
    named = [path for path in Path(folder).rglob("*") if path.is_file() and str(path) in keep]
    if not named:
        shutil.rmtree(folder, ignore_errors=True)
        return
    for path in sorted(Path(folder).rglob("*"), reverse=True):
        if path.is_file() and path not in named:
            path.unlink(missing_ok=True)
        elif path.is_dir() and not any(path.iterdir()):
            path.rmdir()
