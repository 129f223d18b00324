"""Launching fault-tolerant replicas: a Lighthouse, and each replica a world of its own.

`meshpipe train --fault-tolerant` on one machine starts a torchft Lighthouse in the launcher
and each pipeline replica's pp × tp ranks as a separate torch.distributed world (its own
store, hosted here, so p2p between its stages never touches another replica). When a rank
dies, only its replica is killed and relaunched (--max-restarts times each) with a fresh
store; the other replicas never stop: their quorum shrinks until it is back. torch's elastic
agent restarts every rank it started, so this small supervisor replaces it here.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import pickle
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from torch.distributed import TCPStore  # type: ignore[attr-defined]

from engine.comm.launch import RankFailed, names_a_value_error
from engine.comm.replica_group import REPLICA_ENV, ReplicaPlace, lighthouse_url

__all__ = [
    "ReplicaRun",
    "check_lighthouse",
    "first_failure",
    "launch_replicas",
    "lighthouse_for",
    "require_torchft",
    "start_lighthouse",
]

_POLL_S = 0.05
HEARTBEAT_TIMEOUT_MS = 2000
"""A replica whose Manager stops heartbeating this long leaves the quorum."""


def start_lighthouse(join_timeout_s: float) -> Any:
    """A torchft Lighthouse on a free port of this host (quorums of 1 replica and more)."""
    os.environ.setdefault("RUST_LOG", "error")  # else it logs every quorum of every step
    from torchft._torchft import LighthouseServer

    return LighthouseServer(
        bind="[::]:0",
        min_replicas=1,
        join_timeout_ms=int(join_timeout_s * 1000),
        heartbeat_timeout_ms=HEARTBEAT_TIMEOUT_MS,
    )


def require_torchft() -> None:
    """Refuse --fault-tolerant without torchft installed, before anything starts."""
    os.environ.setdefault("RUST_LOG", "error")  # read once, as torchft loads
    try:
        import torchft  # noqa: F401
    except ImportError:
        raise ValueError(
            "--fault-tolerant runs the replicas under torchft, which is not installed: "
            "pip install 'torchft>=0.2' (or meshpipe[fault-tolerance]), or drop --fault-tolerant"
        ) from None


def check_lighthouse(address: str, *, timeout_s: float = 5.0) -> None:
    """Refuse a --lighthouse nothing answers at within `timeout_s`, before ranks start."""
    parts = urlsplit(lighthouse_url(address))
    try:
        port = parts.port
    except ValueError:
        port = None
    if parts.hostname is None or port is None:
        raise ValueError(f"--lighthouse {address!r}: give HOST:PORT of a torchft_lighthouse")
    try:
        with socket.create_connection((parts.hostname, port), timeout=timeout_s):
            return
    except OSError as error:
        raise ValueError(
            f"--lighthouse {address}: no Lighthouse answered within {timeout_s:.0f} s ({error}): "
            f"start one on that host (torchft_lighthouse --min_replicas 1 --bind [::]:{port}), "
            "or give the address of the one running, or drop --lighthouse to start one here"
        ) from None


@dataclass(kw_only=True)
class ReplicaRun:
    """What a fault-tolerant launch returns."""

    results: dict[int, dict[int, Any]] = field(default_factory=dict)
    """Each finished replica's ranks' return values, by replica then rank."""
    relaunches: dict[int, int] = field(default_factory=dict)
    """How often each replica was relaunched."""
    lost: dict[int, str] = field(default_factory=dict)
    """Replicas that died for good (restarts used up), with the first failed rank's error."""


@dataclass(kw_only=True)
class _Replica:
    place: ReplicaPlace
    processes: Sequence[BaseProcess]
    store: TCPStore


def launch_replicas(
    entrypoint: Callable[..., Any],
    args: Sequence[Any],
    *,
    ranks: int,
    replicas: int,
    only: int | None = None,
    lighthouse: str,
    max_restarts: int,
) -> ReplicaRun:
    """Run `entrypoint(*args)` on `ranks` processes per replica, replicas 0 to `replicas - 1`
    (or replica `only`), and supervise them until each has finished or died for good."""
    folder = tempfile.mkdtemp(prefix="meshpipe-replicas-")
    coordinator = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    chosen = [only] if only is not None else list(range(replicas))
    for r in chosen:
        coordinator.set(f"relaunching/{r}", "0")
    run = ReplicaRun()
    live: dict[int, _Replica] = {}
    # what replicas on other machines dial: this replica's store (torchft's process groups
    # meet there) and its Manager; on one machine, the loopback
    host = "127.0.0.1" if only is None else socket.gethostname()

    def start(replica: int, attempt: int) -> None:
        place = ReplicaPlace(
            replica=replica,
            replicas=replicas,
            attempt=attempt,
            lighthouse=lighthouse,
            coordinator=f"127.0.0.1:{coordinator.port}" if only is None else None,
        )
        live[replica] = _start(entrypoint, args, place, ranks, len(chosen), folder, host)

    warnings = os.environ.get("PYTHONWARNINGS")
    # a killed rank never releases its semaphores, which the resource tracker then reports
    os.environ["PYTHONWARNINGS"] = ",".join(
        filter(None, [warnings, "ignore:resource_tracker:UserWarning"])
    )
    try:
        for r in chosen:
            start(r, 0)
        _supervise(live, run, start, coordinator, max_restarts, folder)
    finally:
        for replica in live.values():
            _kill(replica.processes)
        shutil.rmtree(folder, ignore_errors=True)
        if warnings is None:
            os.environ.pop("PYTHONWARNINGS", None)
        else:
            os.environ["PYTHONWARNINGS"] = warnings
    return run


def _supervise(
    live: dict[int, _Replica],
    run: ReplicaRun,
    start: Callable[[int, int], None],
    coordinator: TCPStore,
    max_restarts: int,
    folder: str,
) -> None:
    """Poll the replicas' processes: collect finished ones, relaunch or drop dead ones."""
    while live:
        time.sleep(_POLL_S)
        for r, replica in list(live.items()):
            codes = [p.exitcode for p in replica.processes]
            if all(code == 0 for code in codes):
                run.results[r] = _results(folder, r, len(codes))
                del live[r]
            elif any(code not in (None, 0) for code in codes):
                _kill(replica.processes)
                del live[r]
                attempt = replica.place.attempt
                if attempt < max_restarts and live:  # a live peer to heal from
                    run.relaunches[r] = attempt + 1
                    coordinator.set(f"relaunching/{r}", "1")
                    start(r, attempt + 1)
                else:
                    coordinator.set(f"relaunching/{r}", "0")
                    run.lost[r] = _failure(folder, r, codes)


def _start(
    entrypoint: Callable[..., Any],
    args: Sequence[Any],
    place: ReplicaPlace,
    ranks: int,
    replicas_here: int,
    folder: str,
    host: str,
) -> _Replica:
    """One attempt of a replica: its store (hosted here) and its ranks' processes."""
    store = TCPStore(host, 0, is_master=True, wait_for_workers=False)
    context = multiprocessing.get_context("spawn")
    processes = []
    for rank in range(ranks):
        env = {
            **place.env(),
            "MASTER_ADDR": host,
            "MASTER_PORT": str(store.port),
            "TORCHELASTIC_USE_AGENT_STORE": "True",
            "TORCHELASTIC_RESTART_COUNT": str(place.attempt),
            "RANK": str(rank),
            "WORLD_SIZE": str(ranks),
            "LOCAL_RANK": str(place.replica * ranks + rank),
            "LOCAL_WORLD_SIZE": str(replicas_here * ranks),
        }
        out = Path(folder) / f"replica{place.replica}-rank{rank}"
        process = context.Process(
            target=_rank_main, args=(entrypoint, tuple(args), env, str(out)), daemon=False
        )
        process.start()
        processes.append(process)
    return _Replica(place=place, processes=processes, store=store)


def _rank_main(entrypoint: Callable[..., Any], args: tuple[Any, ...], env: dict[str, str],
               out: str) -> None:  # fmt: skip
    """A rank's process: its environment, then `entrypoint`; its value or its error goes to
    a file the launcher reads."""
    os.environ.update(env)
    os.environ.setdefault("RUST_LOG", "error")  # torchft's quorum logs, one per step and rank
    try:
        value = entrypoint(*args)
    except Exception as error:  # one line: the peers of a dead rank all fail, and are relaunched
        said = f"{type(error).__name__}: {error}"
        Path(out + ".error").write_text(said, encoding="utf-8")
        where = f"replica {env[REPLICA_ENV]} rank {env['RANK']}"
        print(f"meshpipe: {where} failed: {said.splitlines()[0]}", file=sys.stderr, flush=True)
        sys.exit(1)
    temporary = Path(out + ".tmp")
    temporary.write_bytes(pickle.dumps(value))
    temporary.replace(out + ".pickle")


def _results(folder: str, replica: int, ranks: int) -> dict[int, Any]:
    return {
        rank: pickle.loads(Path(folder, f"replica{replica}-rank{rank}.pickle").read_bytes())
        for rank in range(ranks)
    }


def _failure(folder: str, replica: int, codes: list[int | None]) -> str:
    """The first failed rank's error, or how its process ended."""
    for rank in range(len(codes)):
        path = Path(folder, f"replica{replica}-rank{rank}.error")
        if path.is_file():
            return f"replica {replica} rank {rank} failed: {path.read_text(encoding='utf-8')}"
    for rank, code in enumerate(codes):
        if code not in (None, 0):
            how = f"signal {-code}" if code is not None and code < 0 else f"exit code {code}"
            return f"replica {replica} rank {rank} died ({how})"
    return f"replica {replica} failed"


def _kill(processes: Sequence[BaseProcess]) -> None:
    for process in processes:
        if process.exitcode is None:
            process.kill()
    for process in processes:
        process.join()


@contextlib.contextmanager
def lighthouse_for(address: str | None, join_timeout_s: float) -> Iterator[str]:
    """The --lighthouse given, or one started here for the launch's duration."""
    if address is not None:
        yield address
        return
    server = start_lighthouse(join_timeout_s)
    try:
        yield f"127.0.0.1:{urlsplit(server.address()).port}"
    finally:
        server.shutdown()


def first_failure(run: ReplicaRun) -> RankFailed:
    """No replica finished: the first lost one's error (bad input when it was a ValueError)."""
    message = next(iter(run.lost.values()), "every replica failed")
    kind = message.split(": ", 2)[1].split(":", 1)[0] if ": " in message else ""
    return RankFailed(message, bad_input=names_a_value_error(kind))
