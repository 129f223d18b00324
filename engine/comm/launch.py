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
import socket
import tempfile
import uuid
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

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


@contextlib.contextmanager
def _quiet_agent() -> Iterator[None]:
    """The agent logs each failed rank's traceback as errors and a Ctrl-C as a warning;
    `RankFailed` and the CLI say each once. Its loggers carry their own levels, so each is set."""
    prefix = "torch.distributed.elastic"
    names = [prefix, *(n for n in logging.root.manager.loggerDict if n.startswith(prefix + "."))]
    loggers = [logging.getLogger(name) for name in names]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


def launch_local(
    entrypoint: Callable[..., T], nproc: int, *args: Any, max_restarts: int = 0
) -> dict[int, T]:
    """Run `entrypoint(*args)` on `nproc` local ranks; returns each rank's return value.

    Raises `RankFailed` with the first failed rank's error when a rank fails (after
    `max_restarts` restarts of all of them), and `KeyboardInterrupt` when the agent is
    interrupted (Ctrl-C, SIGTERM): it has stopped the ranks by then. The agent's per-rank
    folder (error files) is kept only when a rank failed: the error names its file."""
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
    )
    if max_restarts > 0:
        # The agent's shared TCPStore keeps the previous attempt's keys, so a restarted rank
        # may dial a dead peer's gloo address (pytorch/pytorch#135712): give each attempt a
        # store of its own, hosted by its rank 0.
        os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    try:
        with _quiet_agent():
            results = elastic_launch(config, entrypoint)(*args)
    except ChildFailedError as error:
        raise _first_failure(error) from None
    except SignalException as error:
        shutil.rmtree(log_dir, ignore_errors=True)
        raise KeyboardInterrupt(str(error)) from None
    shutil.rmtree(log_dir, ignore_errors=True)
    return results
