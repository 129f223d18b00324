"""A parameter server per stage: the master weights and the optimizer live on one replica.

The first replica (dp rank 0) of each stage's dp group runs the server in threads beside its
training: it holds an fp32 copy of the stage's parameters (the masters) and the optimizer
over them. Every replica pushes its step's gradient and pulls the masters; the server applies
update t (the optimizer step on the mean of the replicas' step-t gradients, in dp order) once
every replica pushed it, and answers a push of step t once it holds the update of step
t - K (K = `max_staleness`), so no replica runs more than K updates ahead of what it holds and
none waits on a barrier before that. K = 0 is synchronous: every replica computes step t + 1
on the weights every-step sync would give.

Each (server, replica) pair talks over a gloo group of its own, from one thread at each end
(a handler on the server, a sender on the replica), so pipeline traffic and the dp group are
untouched. torch.distributed.rpc, the old route to this, is in maintenance mode.
"""

from __future__ import annotations

import inspect
import queue
import threading
from collections.abc import Callable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from engine.parallel.tensor_parallel import local_tensor

__all__ = ["ParameterServer", "ServerState"]

_CLOSE = -1
"""A header's step that tells the server's handler the replica is done."""


class ServerState:
    """The masters, the optimizer over them and the updates not yet applied (dp rank 0)."""

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        lead: torch.optim.Optimizer,
        *,
        dp: int,
        max_staleness: int,
        timeout_s: float,
    ) -> None:
        self._dp, self.max_staleness, self._timeout_s = dp, max_staleness, timeout_s
        self._lead = lead
        """The engine's optimizer on this rank: the lr schedule sets its hyper-parameters."""
        with torch.no_grad():
            self.masters = [local_tensor(p).detach().to(torch.float32).clone() for p in params]
        self.optimizer = _mirror(lead, params, self.masters)
        self.version = 0
        """Updates applied: the masters are those of the start of step `version`."""
        self._pending: dict[int, dict[int, tuple[torch.Tensor, bool]]] = {}
        self._snapshot: tuple[int, torch.Tensor] | None = None
        self._cond = threading.Condition()
        self.error: BaseException | None = None

    def push(self, dp_rank: int, step: int, flat: torch.Tensor, skipped: bool) -> None:
        """A replica's gradient of `step` (flat fp32); the last of a round applies it."""
        with self._cond:
            assert step >= self.version, f"step {step} pushed after its update was applied"
            self._pending.setdefault(step, {})[dp_rank] = (flat, skipped)
            while len(self._pending.get(self.version, {})) == self._dp:
                self._apply(self._pending.pop(self.version))
                self.version += 1
                self._cond.notify_all()

    def pull(self, step: int) -> tuple[int, torch.Tensor]:
        """The newest masters (version, flat CPU fp32) once they hold the update of
        `step - max_staleness` (what a replica needs before computing `step + 1`)."""
        need = step + 1 - self.max_staleness
        with self._cond:
            if not self._cond.wait_for(
                lambda: self.version >= need or self.error is not None, self._timeout_s
            ):
                raise TimeoutError(
                    f"the parameter server waited {self._timeout_s:.0f}s for update {need - 1}: "
                    "a replica stalled or failed (raise --timeout for slow steps)"
                )
            if self.error is not None:
                raise RuntimeError(f"the parameter server failed: {self.error}")
            if self._snapshot is None or self._snapshot[0] != self.version:
                flat = _flatten_dense_tensors(self.masters).cpu()
                self._snapshot = (self.version, flat)
            return self._snapshot

    def fail(self, error: BaseException) -> None:
        """A handler failed: wake every waiting replica with the error."""
        with self._cond:
            self.error = error
            self._cond.notify_all()

    def _apply(self, round_: Mapping[int, tuple[torch.Tensor, bool]]) -> None:
        """The optimizer step on the replicas' mean gradient, summed in dp order (a round
        with a skipped step is skipped on every replica, as every-step sync skips it)."""
        if any(skipped for _, skipped in round_.values()):
            return
        total = round_[0][0].clone()
        for rank in range(1, self._dp):
            total += round_[rank][0]
        total /= self._dp
        for master, grad in zip(
            self.masters, _unflatten_dense_tensors(total, self.masters), strict=True
        ):
            master.grad = grad.to(master.device)
        for mine, theirs in zip(self.optimizer.param_groups, self._lead.param_groups, strict=True):
            mine.update({k: v for k, v in theirs.items() if k != "params"})
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def _mirror(
    lead: torch.optim.Optimizer, params: Sequence[nn.Parameter], masters: list[torch.Tensor]
) -> torch.optim.Optimizer:
    """An optimizer of `lead`'s class and groups over the masters of its parameters."""
    master_of = {id(p): m for p, m in zip(params, masters, strict=True)}
    groups = [
        {
            **{k: v for k, v in group.items() if k != "params"},
            "params": [master_of[id(p)] for p in group["params"]],
        }
        for group in lead.param_groups
    ]
    accepted = inspect.signature(type(lead)).parameters
    try:
        return type(lead)(groups, **{k: v for k, v in lead.defaults.items() if k in accepted})
    except (TypeError, ValueError) as error:
        raise ValueError(
            f"--dp-sync parameter-server cannot rebuild {type(lead).__name__} over the "
            f"server's master weights ({error}): use --optimizer-impl fused or per_tensor"
        ) from error


class ParameterServer:
    """This rank's side of its stage's parameter server: a replica that pushes and pulls,
    and on dp rank 0 also the server (`state`) with a handler thread per other replica."""

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        lead: torch.optim.Optimizer,
        *,
        dp_rank: int,
        dp: int,
        max_staleness: int,
        links: Mapping[int, tuple[dist.ProcessGroup, int]],
        timeout_s: float,
    ) -> None:
        """`links`: on dp rank 0, each other replica's dp rank → (pair group, its global
        rank); elsewhere {0: (pair group, the server's global rank)}."""
        self._params, self._dp_rank, self._timeout_s = list(params), dp_rank, timeout_s
        self.max_staleness = max_staleness
        self.groups = [group for group, _ in links.values()]
        self.step_count = 0
        self.version = 0
        """The server update this replica's weights hold."""
        self.bytes_pushed = 0
        self.bytes_pulled = 0
        self.staleness: list[int] = []
        """Per step: updates the weights it computed on lacked (the step minus `version`)."""
        self._numel = sum(local_tensor(p).numel() for p in self._params)
        self.state: ServerState | None = None
        self._threads: list[threading.Thread] = []
        self._outbox: queue.Queue[tuple[int, torch.Tensor, bool] | None] = queue.Queue()
        self._received: tuple[int, torch.Tensor | None] = (0, None)
        self._cond = threading.Condition()
        self._error: BaseException | None = None
        # the lr scheduler drives `lead`, which never steps (the server does): no warning
        lead._opt_called = True  # type: ignore[attr-defined]
        if dp_rank == 0:
            self.state = ServerState(
                params, lead, dp=dp, max_staleness=max_staleness, timeout_s=timeout_s
            )
            targets: list[tuple[Callable[..., None], tuple[object, ...]]] = [
                (self._serve, (group, peer, rank)) for rank, (group, peer) in links.items()
            ]
        else:
            group, server = links[0]
            targets = [(self._send, (group, server))]
        for target, args in targets:
            thread = threading.Thread(target=target, args=args, daemon=True, name="param-server")
            thread.start()
            self._threads.append(thread)

    @property
    def bytes_per_step(self) -> float:
        """What this replica sent (gradients) and received (weights) per step, in bytes."""
        return (self.bytes_pushed + self.bytes_pulled) / max(self.step_count, 1)

    def step(self, skipped: bool) -> None:
        """Push this step's gradients; continue with weights at most K updates behind."""
        self.staleness.append(self.step_count - self.version)
        grads = [_grad(p) for p in self._params]
        flat = _flatten_dense_tensors(grads).to("cpu", torch.float32)
        step, self.step_count = self.step_count, self.step_count + 1
        if self.state is not None:
            self.state.push(0, step, flat, skipped)
            self._adopt(*self.state.pull(step))
            return
        self._outbox.put((step, flat, skipped))
        need = step + 1 - self.max_staleness
        with self._cond:
            if not self._cond.wait_for(
                lambda: self._received[0] >= need or self._error is not None, self._timeout_s
            ):
                raise TimeoutError(
                    f"dp rank {self._dp_rank} waited {self._timeout_s:.0f}s for the parameter "
                    f"server's update {need - 1}: a replica stalled or failed"
                )
            if self._error is not None:
                raise RuntimeError(f"pushing to the parameter server failed: {self._error}")
            version, flat_params = self._received
        self._adopt(version, flat_params)

    def _adopt(self, version: int, flat: torch.Tensor | None) -> None:
        """Copy the server's weights of `version` into the stage, when newer than its own."""
        if version <= self.version or flat is None:
            return
        with torch.no_grad():
            locals_ = [local_tensor(p) for p in self._params]
            for tensor, value in zip(locals_, _unflatten_dense_tensors(flat, locals_), strict=True):
                tensor.copy_(value)
        self.version = version

    def _send(self, group: dist.ProcessGroup, server: int) -> None:
        """Replica thread: push each step, read the server's answer (newer weights or none)."""
        try:
            while (item := self._outbox.get()) is not None:
                step, flat, skipped = item
                have = self._received[0]
                dist.send(torch.tensor([step, int(skipped), have]), server, group=group)
                dist.send(flat, server, group=group)
                self.bytes_pushed += 24 + flat.numel() * 4
                answer = torch.zeros(1, dtype=torch.int64)
                dist.recv(answer, server, group=group)
                version, weights = int(answer), None
                if version > have:
                    weights = torch.empty(self._numel, dtype=torch.float32)
                    dist.recv(weights, server, group=group)
                self.bytes_pulled += 8 + (0 if weights is None else weights.numel() * 4)
                with self._cond:
                    if weights is not None:
                        self._received = (version, weights)
                    self._cond.notify_all()
            dist.send(torch.tensor([_CLOSE, 0, 0]), server, group=group)
        except BaseException as error:  # handed to the training thread
            with self._cond:
                self._error = error
                self._cond.notify_all()

    def _serve(self, group: dist.ProcessGroup, peer: int, rank: int) -> None:
        """Server thread for replica `rank`: apply its pushes, answer with fresh weights."""
        assert self.state is not None
        try:
            while True:
                header = torch.zeros(3, dtype=torch.int64)
                dist.recv(header, peer, group=group)
                step, skipped, have = (int(v) for v in header)
                if step == _CLOSE:
                    return
                flat = torch.empty(self._numel, dtype=torch.float32)
                dist.recv(flat, peer, group=group)
                self.state.push(rank, step, flat, bool(skipped))
                version, weights = self.state.pull(step)
                dist.send(torch.tensor([version]), peer, group=group)
                if version > have:
                    dist.send(weights, peer, group=group)
        except BaseException as error:  # handed to the waiting replicas
            self.state.fail(error)

    def reload(self) -> None:
        """The stage's weights were loaded (before the first step): the server's masters
        become them."""
        assert self.step_count == 0, "weights are loaded before the first step"
        if self.state is not None:
            with torch.no_grad():
                for master, param in zip(self.state.masters, self._params, strict=True):
                    master.copy_(local_tensor(param))

    def close(self, *, wait: bool = True) -> None:
        """Stop the threads (after the replicas said they are done, when `wait`)."""
        if self.state is None:
            self._outbox.put(None)
        if wait:
            for thread in self._threads:
                thread.join(self._timeout_s)

    def server_bytes(self) -> int:
        """What the server keeps on this rank: the masters and the optimizer's tensors."""
        if self.state is None:
            return 0
        tensors = list(self.state.masters)
        for state in self.state.optimizer.state.values():
            tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
        return sum(t.numel() * t.element_size() for t in tensors)


def _grad(param: nn.Parameter) -> torch.Tensor:
    grad = param.grad
    if grad is None:
        return torch.zeros_like(local_tensor(param), dtype=torch.float32)
    return local_tensor(grad).to(torch.float32)  # type: ignore[arg-type]
