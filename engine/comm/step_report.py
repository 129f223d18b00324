"""What a step reports from every pipeline rank, exchanged without a barrier.

The loss lives on the last stage and the bubble needs every rank's busy time. Gathering them
with a collective at each step's end would make every rank wait for the slowest, so the next
step's warm-up could never overlap this step's drain. Instead the last stage sends its loss to
the other ranks right after its last forward (long before any of them finishes the step), and
each rank sends its own figures to its peers when it finishes; a step's figures are read when
asked for. By the end of step k every rank has finished step k-1 (its own step k needed data
that its peers produced after finishing k-1), so reading step k-1's figures then never waits.

The reports travel over their own group (`engine.channels`), apart from the activations, and
each rank's figures go out and come in as one batch: NCCL matches messages by order, not tag,
and a rank's send to a peer must not queue behind its receive from that peer.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from engine.comm.collective import naming_failures

__all__ = ["StepReports"]


class StepReports:
    """One rank's end of the per-step exchange over its pipeline group (p2p only)."""

    def __init__(
        self,
        *,
        group: dist.ProcessGroup | None,
        ranks: Sequence[int],
        me: int,
        last: int,
        device: torch.device,
        timeout_s: float,
    ) -> None:
        self._group, self._ranks, self._me, self._last = group, tuple(ranks), me, last
        self._device = device
        self._timeout = timedelta(seconds=timeout_s)
        self._loss: torch.Tensor | None = None
        self._loss_works: list[dist.Work] = []

    @property
    def _peers(self) -> list[int]:
        return [r for r in self._ranks if r != self._me]

    def begin_step(self) -> None:
        """Post the receive of this step's loss (ranks other than the last stage's)."""
        self._loss, self._loss_works = None, []
        if self._me != self._last and len(self._ranks) > 1:
            self._loss = torch.empty((), dtype=torch.float32, device=self._device)
            with self._naming("the loss"):  # gloo refuses to post to a peer already gone
                work = dist.irecv(self._loss, src=self._last, group=self._group)
            assert work is not None
            self._loss_works = [work]

    def send_loss(self, loss: torch.Tensor) -> None:
        """On the last stage, after its last forward: the step's mean loss to every peer."""
        self._loss = loss.detach().to(self._device, torch.float32).reshape(())
        for peer in self._peers:
            with self._naming("the loss"):
                work = dist.isend(self._loss, dst=peer, group=self._group)
            assert work is not None
            self._loss_works.append(work)

    def loss(self) -> torch.Tensor:
        """This step's mean loss over the pipeline's micro-batches (the same on every rank)."""
        for work in self._loss_works:
            self._wait(work, "the loss")
        self._loss_works = []
        if self._loss is None:
            raise RuntimeError("the last pipeline stage ran no forward in this step")
        return self._loss

    def publish(self, figures: torch.Tensor) -> Callable[[], torch.Tensor]:
        """Send this rank's `figures` (1-d, float64) to every peer; the returned function
        waits for theirs once and returns all of them stacked in pipeline-rank order."""
        mine = figures.to(torch.float64).to(self._device)
        theirs = {r: torch.empty_like(mine) for r in self._peers}
        ops = [dist.P2POp(dist.isend, mine, r, self._group) for r in self._peers] + [
            dist.P2POp(dist.irecv, theirs[r], r, self._group) for r in self._peers
        ]
        with self._naming("step figures"):
            works = dist.batch_isend_irecv(ops)

        @functools.cache
        def resolve() -> torch.Tensor:
            for work in works:
                self._wait(work, "step figures")
            return torch.stack([theirs.get(r, mine) for r in self._ranks]).cpu()

        return resolve

    def _wait(self, work: dist.Work, what: str) -> None:
        with self._naming(what):
            work.wait(self._timeout)

    def _naming(self, what: str) -> contextlib.AbstractContextManager[None]:
        """A failure to post or complete an exchange of `what`, named with the peers."""
        where = f"exchanging {what} with its pipeline peers {self._peers}"
        return naming_failures(where, timeout_s=self._timeout.total_seconds())
