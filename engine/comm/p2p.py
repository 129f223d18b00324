"""Activation and gradient exchange between pipeline stages.

The first exchange on an edge carries a small header with the number, shapes, dtypes and
requires-grad flags of the tensors that follow; later exchanges reuse it (no per-message shape
negotiation) and the sender checks every message against it, so a stage whose output changes
shape fails with both shapes named instead of corrupting its peer. Sends are posted
asynchronously and awaited once the schedule proves them delivered (`engine.schedule.delivery`)
or at the end of the step; every wait has a timeout. Each edge
travels over its own process group (`engine.channels`), in order, without tags: what NCCL
needs, and what gloo then tests on the CPU. Gloo cannot send CUDA tensors, so ranks that share
a GPU over gloo stage each message through host memory (the *wire* device).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from engine.comm.channels import Edge
from engine.comm.collective import peer_failed
from engine.schedule.actions import Action, ActionKind

__all__ = ["ExchangeError", "StageExchange", "TensorMeta"]

_HEADER_LEN = 128
_DTYPES = (
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.bool,
    torch.uint8,
)


class ExchangeError(RuntimeError):
    """A message that does not match its edge's header, or a peer that never answered."""


@dataclass(frozen=True)
class TensorMeta:
    """What the receiver must allocate for one tensor."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool

    @staticmethod
    def of(tensor: torch.Tensor) -> TensorMeta:
        grad = tensor.requires_grad or (tensor.is_floating_point() and tensor.grad_fn is not None)
        return TensorMeta(tuple(tensor.shape), tensor.dtype, grad)


def _encode(metas: tuple[TensorMeta, ...], device: torch.device) -> torch.Tensor:
    values = [len(metas)]
    for meta in metas:
        values += [_DTYPES.index(meta.dtype), int(meta.requires_grad), len(meta.shape), *meta.shape]
    if len(values) > _HEADER_LEN:
        raise ExchangeError(f"too many or too high-dimensional tensors for one message: {metas}")
    header = torch.zeros(_HEADER_LEN, dtype=torch.int64)
    header[: len(values)] = torch.tensor(values)
    return header.to(device)


def _decode(header: torch.Tensor) -> tuple[TensorMeta, ...]:
    values = header.tolist()
    metas, pos = [], 1
    for _ in range(values[0]):
        dtype, grad, ndim = values[pos : pos + 3]
        shape = tuple(values[pos + 3 : pos + 3 + ndim])
        metas.append(TensorMeta(shape, _DTYPES[dtype], bool(grad)))
        pos += 3 + ndim
    return tuple(metas)


def _edge(action: Action) -> tuple[int, int, str]:
    """(sending stage, receiving stage, direction) of a communication action."""
    s = action.stage
    if action.kind is ActionKind.SEND_F:
        return s, s + 1, "activations"
    if action.kind is ActionKind.RECV_F:
        return s - 1, s, "activations"
    if action.kind is ActionKind.SEND_B:
        return s, s - 1, "gradients"
    return s + 1, s, "gradients"


class StageExchange:
    """One rank's sends and receives over its pipeline group (keeps headers and pending sends)."""

    def __init__(
        self,
        *,
        groups: Mapping[Edge, dist.ProcessGroup],
        global_rank_of_stage: dict[int, int],
        device: torch.device,
        timeout_s: float,
        wire_device: torch.device | None = None,
    ) -> None:
        self._groups = groups
        self._rank_of = global_rank_of_stage
        self._device = device
        self._wire = wire_device or device
        """Where messages live in transit: the host when gloo carries a GPU's tensors."""
        self._timeout = timedelta(seconds=timeout_s)
        self._sent: dict[tuple[int, int, bool], tuple[TensorMeta, ...]] = {}
        self._received: dict[tuple[int, int, bool], tuple[TensorMeta, ...]] = {}
        self._pending: list[tuple[dist.Work, tuple[torch.Tensor, ...], Action]] = []
        self._posted: dict[Action, tuple[tuple[torch.Tensor, ...], list[dist.Work]]] = {}

    @property
    def sent_shapes(self) -> dict[tuple[int, int], list[tuple[int, ...]]]:
        """The shapes each edge (sending stage, receiving stage) carried in training."""
        return {
            (src, dst): [m.shape for m in metas]
            for (src, dst, training), metas in self._sent.items()
            if training
        }

    def send(self, action: Action, tensors: tuple[torch.Tensor, ...], *, training: bool) -> None:
        """Post the tensors of `action` (SEND_F or SEND_B) without waiting for delivery."""
        src, dst, what = _edge(action)
        key = (src, dst, training)
        metas = tuple(TensorMeta.of(t) for t in tensors)
        group, peer = self._groups[(src, dst)], self._rank_of[dst]
        if key not in self._sent:
            self._sent[key] = metas
            header = _encode(metas, self._wire)
            self._pending.append((self._isend(header, peer, group, action), (header,), action))
        elif metas != self._sent[key]:
            raise ExchangeError(
                f"stage {src} sends {what} of micro-batch {action.micro_batch} to stage {dst} "
                f"with shapes {[m.shape for m in metas]} (dtypes {[m.dtype for m in metas]}), "
                f"but this edge carries {[m.shape for m in self._sent[key]]} "
                f"(dtypes {[m.dtype for m in self._sent[key]]}): every micro-batch must have "
                "the same shapes; check the layers at the stage boundary and the batch size"
            )
        payload = tuple(t.detach().contiguous().to(self._wire) for t in tensors)
        for tensor in payload:
            self._pending.append((self._isend(tensor, peer, group, action), payload, action))

    @property
    def unsettled_sends(self) -> tuple[Action, ...]:
        """The sends still held (posted, not yet known delivered), in posting order."""
        return tuple(dict.fromkeys(action for _, _, action in self._pending))

    def post_ahead(self, action: Action, *, training: bool) -> None:
        """Post the receive of `action` now, so its data lands while this rank computes.

        Only once the edge's header is known (from the second step on); `recv` then just
        waits. Receives on one edge are posted in the order the peer sends them.
        """
        src, dst, _ = _edge(action)
        key = (src, dst, training)
        if key not in self._received or action in self._posted:
            return
        group, peer = self._groups[(src, dst)], self._rank_of[src]
        tensors = tuple(
            torch.empty(m.shape, dtype=m.dtype, device=self._wire) for m in self._received[key]
        )
        works = [self._irecv(t, peer, group, action) for t in tensors]
        self._posted[action] = (tensors, works)

    def recv(self, action: Action, *, training: bool) -> tuple[torch.Tensor, ...]:
        """Receive the tensors of `action` (RECV_F or RECV_B), waiting at most the timeout."""
        src, dst, what = _edge(action)
        key = (src, dst, training)
        if key not in self._received:
            header = torch.empty(_HEADER_LEN, dtype=torch.int64, device=self._wire)
            header_work = self._irecv(header, self._rank_of[src], self._groups[(src, dst)], action)
            self._wait(header_work, action, what)
            self._received[key] = _decode(header.cpu())
        self.post_ahead(action, training=training)
        tensors, works = self._posted.pop(action)
        for work in works:
            self._wait(work, action, what)
        grads = [m.requires_grad and training for m in self._received[key]]
        arrived = (t.to(self._device) for t in tensors)
        return tuple(t.requires_grad_(g) for t, g in zip(arrived, grads, strict=True))

    def release(self, sends: tuple[Action, ...]) -> None:
        """Wait on `sends` now and drop their buffers: the caller knows them delivered (the
        schedule's `released_at`), so the wait returns at once and the buffers do not stay
        alive to the step's end."""
        done = [entry for entry in self._pending if entry[2] in sends]
        if not done:
            return
        self._pending = [entry for entry in self._pending if entry[2] not in sends]
        for work, _, action in done:
            self._wait(work, action, _edge(action)[2])

    def wait_sends(self) -> None:
        """Wait until every posted send was delivered (end of step: buffers may be freed):
        those no later receive proved delivered, and in evaluation the activations."""
        pending, self._pending = self._pending, []
        for work, _, action in pending:
            self._wait(work, action, "data")

    def _irecv(
        self, tensor: torch.Tensor, peer: int, group: dist.ProcessGroup, action: Action
    ) -> dist.Work:
        try:
            work = dist.irecv(tensor, src=peer, group=group)
        except RuntimeError as error:  # gloo refuses to post to a peer already gone
            raise self._failed(action, _edge(action)[2], error) from error
        assert work is not None
        return work

    def _isend(
        self, tensor: torch.Tensor, peer: int, group: dist.ProcessGroup, action: Action
    ) -> dist.Work:
        try:
            work = dist.isend(tensor, dst=peer, group=group)
        except RuntimeError as error:
            raise self._failed(action, _edge(action)[2], error) from error
        assert work is not None
        return work

    def _wait(self, work: dist.Work | None, action: Action, what: str) -> None:
        assert work is not None
        try:
            work.wait(self._timeout)
        except RuntimeError as error:
            raise self._failed(action, what, error) from error

    def _failed(self, action: Action, what: str, error: Exception) -> ExchangeError:
        """A transfer that failed to post or to complete, named by its edge and ranks."""
        src, dst, _ = _edge(action)
        return ExchangeError(
            f"{action}: exchanging {what} of micro-batch {action.micro_batch} between stage "
            f"{src} (rank {self._rank_of.get(src)}) and stage {dst} (rank "
            f"{self._rank_of.get(dst)}) failed: {error}. "
            + peer_failed(self._timeout.total_seconds(), peer="The peer")
        )
