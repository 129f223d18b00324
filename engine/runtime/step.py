"""One step's state on one rank: the handler table the interpreter runs a schedule through.

Holds what lives only for a step — the micro-batches, tensors received and waiting to be sent,
the losses — and turns each action into a call on a stage or on the exchange.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from engine.runtime.micro_batches import split_micro_batches
from engine.schedule.actions import Action, ActionKind

if TYPE_CHECKING:
    from engine.runtime.engine import PipelineEngine

__all__ = ["StepRun"]


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
        engine: PipelineEngine,
        inputs: torch.Tensor | None,
        targets: torch.Tensor | None,
        *,
        training: bool,
    ) -> None:
        m = engine.micro_batches
        if engine.is_first and inputs is None:
            raise ValueError("the first pipeline stage needs the batch's inputs")
        if engine.is_last and targets is None:
            raise ValueError("the last pipeline stage needs the batch's targets")
        self.engine, self.training = engine, training
        device = engine.mesh.device  # a loader's CPU batch goes to the GPU once per step
        self.inputs = (
            split_micro_batches(inputs.to(device, non_blocking=True), m)
            if engine.is_first and inputs is not None
            else ()
        )
        self.targets = (
            split_micro_batches(targets.to(device, non_blocking=True), m)
            if engine.is_last and targets is not None
            else ()
        )
        self.activations: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}
        self.gradients: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}
        self.outbox: dict[tuple[ActionKind, int, int], tuple[torch.Tensor, ...]] = {}
        self.losses: list[torch.Tensor] = []
        row = engine.schedule.rows[engine.mesh.pp_rank]
        self._grads_left = sum(a.kind in (ActionKind.B, ActionKind.W) for a in row)
        schedule = engine.schedule if training else engine.eval_schedule
        firsts, self._next_recv = _receive_plan(schedule.rows[engine.mesh.pp_rank])
        for first in firsts:
            engine.exchange.post_ahead(first, training=training)

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
        stage = self.engine.stages[s]
        inputs = (self.inputs[k],) if stage.is_first else self.activations.pop((s, k))
        divisor = self.engine.micro_batches * self.engine.mesh.dp
        scaler = self.engine.scaler
        outputs = stage.forward(
            k,
            inputs,
            targets=self.targets[k] if stage.is_last else None,
            loss_divisor=divisor,
            loss_scale=scaler.scale if scaler is not None else 1.0,
            training=self.training,
            split=(s, k) in self.engine.split_units,
        )
        if stage.is_last:
            self.losses.append(outputs[0])
            if len(self.losses) == self.engine.micro_batches:
                self.engine.reports.send_loss(torch.stack(self.losses).mean())
        elif s + 1 in self.engine.stages:
            self.activations[(s + 1, k)] = tuple(o.detach().requires_grad_() for o in outputs)
        else:
            self.outbox[(ActionKind.SEND_F, s, k)] = outputs

    def backward(self, action: Action) -> None:
        s, k = action.stage, action.micro_batch
        stage = self.engine.stages[s]
        grads = () if stage.is_last else self.gradients.pop((s, k))
        if action.kind is ActionKind.I:
            input_grads = stage.backward_input(k, grads)
        else:
            input_grads = stage.backward(k, grads)
            self._gradient_done()
        if s > 0 and s - 1 in self.engine.stages:
            self.gradients[(s - 1, k)] = input_grads
        elif s > 0:
            self.outbox[(ActionKind.SEND_B, s, k)] = input_grads

    def weight_grad(self, action: Action) -> None:
        self.engine.stages[action.stage].backward_weight(action.micro_batch)
        self._gradient_done()

    def _gradient_done(self) -> None:
        """After the rank's last B or W of the step, its gradients are final: reduce them."""
        self._grads_left -= 1
        if self._grads_left == 0 and self.engine.mesh.dp > 1:
            self.engine._dp_reduce.start()

    def send(self, action: Action) -> None:
        tensors = self.outbox.pop((action.kind, action.stage, action.micro_batch))
        self.engine.exchange.send(action, tensors, training=self.training)

    def recv(self, action: Action) -> None:
        exchange = self.engine.exchange
        tensors = exchange.recv(action, training=self.training)
        following = self._next_recv.get(action)
        if following is not None:
            exchange.post_ahead(following, training=self.training)
        box = self.activations if action.kind is ActionKind.RECV_F else self.gradients
        box[(action.stage, action.micro_batch)] = tensors
