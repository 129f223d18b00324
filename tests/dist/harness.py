"""Spawn N gloo ranks on this machine, run a function on each, collect what it returns.

Each rank is a fresh process (forked from a server that preloaded torch: `_context`) with the
launcher environment torchrun would set and one intra-op thread. Results travel back
serialised with `torch.save`. A rank that raises fails the caller with its traceback; ranks
that do not finish within `timeout_s` are killed.
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import queue
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

from engine.comm.launch import free_port

__all__ = ["RanksFailed", "free_port", "run_ranks"]


class RanksFailed(AssertionError):
    """At least one rank raised or the group timed out."""


def _worker(
    fn: Callable[..., Any], rank: int, world_size: int, port: int, out: Any, args: tuple[Any, ...]
) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    torch.set_num_threads(1)
    try:
        result = fn(rank, world_size, *args)
        buffer = io.BytesIO()
        torch.save(result, buffer)
        out.put((rank, "ok", buffer.getvalue()))
    except BaseException:
        out.put((rank, "error", traceback.format_exc()))
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def _collect(
    procs: list[Any], out: Any, results: dict[int, Any], errors: dict[int, str], timeout_s: float
) -> None:
    """Gather every rank's report; a rank that died silently or overstayed is an error."""
    deadline = time.monotonic() + timeout_s
    dead_since: dict[int, float] = {}
    while len(results) + len(errors) < len(procs):
        try:
            rank, status, payload = out.get(timeout=0.2)
        except queue.Empty:
            now = time.monotonic()
            for rank, proc in enumerate(procs):
                if rank in results or rank in errors or proc.is_alive():
                    continue
                if now - dead_since.setdefault(rank, now) > 2.0:
                    errors[rank] = f"exited with code {proc.exitcode} without reporting"
            if now > deadline:
                missing = sorted(set(range(len(procs))) - set(results) - set(errors))
                errors[-1] = f"ranks {missing} did not finish within {timeout_s}s"
                return
            continue
        if status == "ok":
            results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
        else:
            errors[rank] = payload


def _context() -> Any:
    """Fresh processes forked from a server that imported torch and the engine once: a rank
    then starts in a fraction of a second instead of re-importing them (seconds of CPU each,
    which on 2 cores dominated the multi-rank tests). The server forks before any thread or
    process group exists, so each rank starts as clean as a spawned one. The engine imports
    DTensor, FSDP2 and dynamo only where a run uses them (`engine.comm.dtensor`); the server
    imports them once for every rank."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(
        [
            "torch",
            "torch._dynamo",
            "torch.distributed.tensor",
            "torch.distributed.fsdp",
            "engine.runtime.engine",
            "tests.dist.cases",
        ]
    )
    return ctx


def run_ranks(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 240.0
) -> list[Any]:
    """Run `fn(rank, world_size, *args)` on `world_size` ranks; returns results by rank."""
    ctx = _context()
    out = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(fn, rank, world_size, port, out, args), daemon=True)
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    try:
        _collect(procs, out, results, errors, timeout_s)
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
    if errors:
        raise RanksFailed("\n".join(f"--- rank {r} ---\n{e}" for r, e in sorted(errors.items())))
    return [results[r] for r in range(world_size)]
