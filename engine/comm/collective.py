"""Blocking collectives that say who was waiting for what when a peer fails.

gloo's own timeout says only "Timed out waiting 300000ms for recv operation to complete": a
user with eight ranks needs this rank, the operation it was in and the way out. The p2p
exchange (`engine.p2p`) and the step reports (`engine.step_report`) word theirs alike.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch.distributed as dist

from engine.comm.heartbeat import doing

__all__ = ["CollectiveError", "naming_failures", "peer_failed"]


def peer_failed(timeout_s: float, *, peer: str = "A peer") -> str:
    """The end of every communication error: what likely happened and the way out."""
    return (
        f"{peer} crashed, stalled or timed out ({timeout_s:.0f}s; raise --timeout for slow steps)"
    )


class CollectiveError(RuntimeError):
    """A collective over the mesh failed or timed out; the message names rank and operation."""


@contextlib.contextmanager
def naming_failures(what: str, *, timeout_s: float) -> Iterator[None]:
    """Re-raise a communication failure inside the block as a `CollectiveError` naming `what`."""
    try:
        with doing(what):
            yield
    except CollectiveError:
        raise
    except RuntimeError as error:
        rank = dist.get_rank() if dist.is_initialized() else 0
        raise CollectiveError(
            f"rank {rank}: {what} failed: {error}. {peer_failed(timeout_s)}"
        ) from error
