"""Every rank agrees, or every rank fails: the collective patterns a checkpoint's save and load
share, so a failure on one rank is raised on all of them instead of leaving peers waiting.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn, TypeVar, cast

import torch.distributed as dist

from engine.checkpoint.files import CheckpointError

__all__ = ["CheckpointIOError", "everywhere", "gather", "rank0_decides"]

T = TypeVar("T")


def gather(value: object) -> list[Any]:
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [value]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def rank0_decides(fn: Callable[[], T]) -> T:
    """`fn` on rank 0, its result (or its CheckpointError) on every rank: ranks that each
    read `latest` and list the step folders could see different files (no shared filesystem,
    a save racing the load) and walk different candidates into mismatched collectives."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return fn()
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            box = [(fn(), None)]
        except Exception as error:  # told to every rank, so none waits for the others
            box = [(None, str(error))]
    dist.broadcast_object_list(box, src=0)
    result, failure = box[0]
    if failure is not None:
        raise CheckpointError(failure)
    return cast(T, result)


class CheckpointIOError(OSError):
    """The machine, not the checkpoint, failed a rank's read or write (a full disk, a lost
    mount, no permission): the CLI's status 1, where a bad checkpoint is bad input (2)."""


def _failures(what: str, gathered: list[tuple[Any, str | None]]) -> str:
    return f"{what} failed on " + "; ".join(
        f"rank {rank}: {error}" for rank, (_, error) in enumerate(gathered) if error
    )


def _raise(what: str, gathered: list[tuple[Any, str | None]]) -> NoReturn:
    """Every rank raises the same error: `CheckpointIOError` if any rank's was the machine's
    (told by its `OSError: ` prefix), else `CheckpointError`."""
    message = _failures(what, gathered)
    if any(error and error.startswith(_IO_PREFIX) for _, error in gathered):
        raise CheckpointIOError(message.replace(_IO_PREFIX, ""))
    raise CheckpointError(message)


_IO_PREFIX = "OSError: "


def _told(error: Exception) -> str:
    """`error` as told to the other ranks."""
    machine = isinstance(error, OSError) and not isinstance(error, CheckpointError)
    return f"{_IO_PREFIX if machine else ''}{error}"


def everywhere(
    what: str, fn: Callable[[], T], report: Callable[[T], Any] = lambda _: None
) -> tuple[T, list[Any]]:
    """Run `fn` on every rank and gather `report(result)`. If any rank failed, every rank
    raises, so no peer is left waiting in a later collective."""
    try:
        result = fn()
    except Exception as error:  # told to every rank, then raised here too
        _raise(what, gather((None, _told(error))))
    gathered = gather((report(result), None))
    if any(error for _, error in gathered):
        _raise(what, gathered)
    return result, [shared for shared, _ in gathered]
