"""One step's state on one rank: the handler table the interpreter runs a schedule through.

Holds what lives only for a step — the micro-batches, tensors received and waiting to be sent,
the losses — and turns each action into a call on a stage or on the exchange. It sees the
engine only through a `StepContext`: what a step needs, and nothing else.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from engine.comm.p2p import StageExchange
from engine.comm.step_report import StepReports
from engine.parallel import SequenceShards
from engine.runtime.micro_batches import split_micro_batches
from engine.runtime.stage import PipelineStage
from engine.schedule.actions import Action, ActionKind

__all__ = ["StepContext", "StepRun"]


@dataclass(frozen=True, kw_only=True)
class StepContext:
    """What one step of one rank needs: its stages, its row of actions, how each micro-batch
    loss is scaled, and the exchange and reports it talks through."""

    stages: Mapping[int, PipelineStage]
    """The stages this rank holds, by stage id."""
    row: tuple[Action, ...]
    """This rank's lowered actions for the step (the training or the evaluation schedule)."""
    micro_batches: int
    """Micro-batches per replica and step."""
    loss_divisor: int
    """What each micro-batch loss is divided by: micro-batches × replicas, as the reference."""
    loss_scale: float
    """fp16's loss scale (1 otherwise)."""
    split_units: frozenset[tuple[int, int]]
    """(stage, micro-batch) pairs whose backward runs as I then W."""
    device: torch.device
    """Where this rank computes: a loader's CPU batch moves here once per step."""
    exchange: StageExchange
    reports: StepReports
    gradients_final: Callable[[], None]
    """Called after the rank's last B or W: its gradients are final (the dp reduction starts)."""
    releases: Mapping[Action, tuple[Action, ...]] = dataclasses.field(default_factory=dict)
    """The sends each receive of the row proves delivered (`released_at`): freed on arrival."""
    shards: SequenceShards | None = None
    """Under tensor parallelism: send 1/tp of each boundary tensor, all-gather what arrives."""

    @property
    def is_first(self) -> bool:
        return any(stage.is_first for stage in self.stages.values())

    @property
    def is_last(self) -> bool:
        return any(stage.is_last for stage in self.stages.values())


@functools.lru_cache(maxsize=16)
def _receive_plan(row: tuple[Action, ...]) -> tuple[tuple[Action, ...], dict[Action, Action]]:
    """A row's first receive on each edge (same kind and stage) and each receive's successor on
    its edge; a schedule's rows never change, so this is worked out once per row, not per step."""
    last: dict[tuple[ActionKind, int], Action] = {}
    firsts: list[Action] = []
    following: dict[Action, Action] = {}
    for action in row:
        if action.kind not in (ActionKind.RECV_F, ActionKind.RECV_B):
            continue
        edge = (action.kind, action.stage)
        if edge in last:
            following[last[edge]] = action
        else:
            firsts.append(action)
        last[edge] = action
    return tuple(firsts), following


class StepRun:
    """Per-step state of one rank: micro-batches, tensors waiting to be sent, losses."""

    def __init__(
        self,
        context: StepContext,
        inputs: torch.Tensor | None,
        targets: torch.Tensor | None,
        *,
        training: bool,
        documents: torch.Tensor | None = None,
    ) -> None:
        """`documents`: the batch's document ids (packed documents), given to every stage."""
        if context.is_first and inputs is None:
            raise ValueError("the first pipeline stage needs the batch's inputs")
        if context.is_last and targets is None:
            raise ValueError("the last pipeline stage needs the batch's targets")
        self.context, self.training = context, training
        self.inputs = _split(inputs, context) if context.is_first else ()
        self.targets = _split(targets, context) if context.is_last else ()
        self.documents = _split(documents, context) if documents is not None else None
        self.activations: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}
        self.gradients: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}
        self.outbox: dict[tuple[ActionKind, int, int], tuple[torch.Tensor, ...]] = {}
        self.losses: list[torch.Tensor] = []
        self._grads_left = sum(a.kind in (ActionKind.B, ActionKind.W) for a in context.row)
        firsts, self._next_recv = _receive_plan(context.row)
        for first in firsts:
            context.exchange.post_ahead(first, training=training)

    def handlers(self) -> dict[ActionKind, Callable[[Action], None]]:
        return {
            ActionKind.F: self.forward,
            ActionKind.B: self.backward,
            ActionKind.I: self.backward,
            ActionKind.W: self.weight_grad,
            ActionKind.SEND_F: self.send,
            ActionKind.SEND_B: self.send,
            ActionKind.RECV_F: self.recv,
            ActionKind.RECV_B: self.recv,
        }

    def forward(self, action: Action) -> None:
        s, k = action.stage, action.micro_batch
        context = self.context
        stage = context.stages[s]
        inputs = (self.inputs[k],) if stage.is_first else self.activations.pop((s, k))
        outputs = stage.forward(
            k,
            inputs,
            targets=self.targets[k] if stage.is_last else None,
            loss_divisor=context.loss_divisor,
            loss_scale=context.loss_scale,
            training=self.training,
            split=(s, k) in context.split_units,
            documents=None if self.documents is None else self.documents[k],
        )
        if stage.is_last:
            self.losses.append(outputs[0])
            if len(self.losses) == context.micro_batches:
                context.reports.send_loss(torch.stack(self.losses).mean())
        elif s + 1 in context.stages:
            self.activations[(s + 1, k)] = tuple(o.detach().requires_grad_() for o in outputs)
        else:
            self.outbox[(ActionKind.SEND_F, s, k)] = outputs

    def backward(self, action: Action) -> None:
        s, k = action.stage, action.micro_batch
        stage = self.context.stages[s]
        grads = () if stage.is_last else self.gradients.pop((s, k))
        if action.kind is ActionKind.I:
            input_grads = stage.backward_input(k, grads)
        else:
            input_grads = stage.backward(k, grads)
            self._gradient_done()
        if s > 0 and s - 1 in self.context.stages:
            self.gradients[(s - 1, k)] = input_grads
        elif s > 0:
            self.outbox[(ActionKind.SEND_B, s, k)] = input_grads

    def weight_grad(self, action: Action) -> None:
        self.context.stages[action.stage].backward_weight(action.micro_batch)
        self._gradient_done()

    def _gradient_done(self) -> None:
        """After the rank's last B or W of the step, its gradients are final: reduce them."""
        self._grads_left -= 1
        if self._grads_left == 0:
            self.context.gradients_final()

    def send(self, action: Action) -> None:
        tensors = self.outbox.pop((action.kind, action.stage, action.micro_batch))
        if self.context.shards is not None:
            tensors = self.context.shards.outgoing(tensors)
        self.context.exchange.send(action, tensors, training=self.training)

    def recv(self, action: Action) -> None:
        exchange = self.context.exchange
        tensors = exchange.recv(action, training=self.training)
        exchange.release(self.context.releases.get(action, ()))
        if self.context.shards is not None:
            tensors = self.context.shards.incoming(tensors)
        following = self._next_recv.get(action)
        if following is not None:
            exchange.post_ahead(following, training=self.training)
        box = self.activations if action.kind is ActionKind.RECV_F else self.gradients
        box[(action.stage, action.micro_batch)] = tensors


def _split(batch: torch.Tensor | None, context: StepContext) -> tuple[torch.Tensor, ...]:
    """The batch on this rank's device, in micro-batches (views)."""
    assert batch is not None
    return split_micro_batches(batch.to(context.device, non_blocking=True), context.micro_batches)
