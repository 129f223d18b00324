"""A stage's part of a training step, replayed as the runtime runs it, for the memory tracker.

The replay drives the runtime's own `PipelineStage` (forward, backward, the I/W split,
autocast and its per-step weight casts, recompute) around prebuilt layers, fake or real, and
mirrors the few things `engine._Step` and `StageExchange` add around it: receive buffers, sends
held until delivered for certain (an output until its gradient arrives, a gradient until the
step's end), the step's batch and losses. So the tracker measures the runtime's
code, not a copy of it.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from engine.comm.ties import share_local_ties
from engine.memory.tracker import round_up
from engine.runtime.precision import LossScaler, compute_dtype
from engine.runtime.stage import PipelineStage
from engine.schedule.actions import COMPUTE_KINDS, Action, ActionKind
from engine.schedule.delivery import released_at
from engine.schedule.passes import as_lowered
from engine.schedule.schedule import Schedule
from models import LayerSpec, LayerStack

__all__ = [
    "StageRun",
    "StageShape",
    "backward_styles",
    "build_stage",
    "fake_parameters",
    "in_flight",
    "local_edges",
    "rank_events",
    "sends_released",
    "stage_actions",
]


@dataclass(frozen=True, kw_only=True)
class StageShape:
    """What every micro-batch of a step looks like (all micro-batches are alike)."""

    micro_batches: int
    micro_batch_size: int
    seq_len: int
    hidden: int
    """Width of the activations that cross stage boundaries (d_model)."""
    divisor: int
    """What the last stage divides each micro-batch loss by (m · dp), as the engine does."""
    precision: str
    """`fp32`, `bf16` or `fp16`, as `EngineOptions.precision`."""
    recompute: str
    """Recompute policy of the stage, as `EngineOptions.recompute`."""
    tp: int = 1
    """Tensor-parallel ranks the stage's layers are split over (the replay runs one's share)."""
    sequence_parallel: bool = False
    """Sequence parallelism: activations between blocks, and those crossing stage boundaries,
    are 1/tp of the sequence."""
    fsdp_replicas: int = 0
    """ZeRO-3: the data-parallel replicas FSDP2 shards every layer over (the replay runs the
    engine's `shard_layers` on a fake world of them); 0 without ZeRO-3."""
    fsdp_reshard: str = "step"
    """ZeRO-3: when a layer gives its gathered weights back, as `--zero-reshard`."""

    @property
    def boundary_seq_len(self) -> int:
        """Sequence length of what a stage receives and sends (its shard's under sequence
        parallelism; after the all-gather of the received shards otherwise)."""
        return self.seq_len // self.tp if self.sequence_parallel else self.seq_len


def build_stage(specs: Sequence[LayerSpec]) -> LayerStack:
    """The stage's layers on the meta device, weights tied inside the stage shared (the
    runtime's stage splits them over tp, as the engine does).

    `models.build_layers` would initialise every weight on the CPU first, which planning a
    70B stage cannot afford.
    """
    stack = LayerStack({i: spec.build("meta") for i, spec in enumerate(specs)})
    share_local_ties(specs, [stack])
    return stack


def fake_parameters(module: nn.Module) -> None:
    """Give a meta module fake fp32 CPU parameters (inside a `FakeTensorMode`)."""
    made: dict[int, nn.Parameter] = {}
    for sub in module.modules():
        for name, param in list(sub._parameters.items()):
            if param is not None:
                if id(param) not in made:
                    made[id(param)] = nn.Parameter(torch.empty(param.shape))
                sub._parameters[name] = made[id(param)]


def _runtime_stage(
    module: LayerStack,
    specs: Sequence[LayerSpec],
    *,
    first: bool,
    last: bool,
    shape: StageShape,
    tp_mesh: DeviceMesh | None = None,
) -> PipelineStage:
    """The runtime's `PipelineStage` around prebuilt (fake or already built) layers, split
    over `tp_mesh` as the engine splits them (a measured run's real DTensors)."""
    num_stages = 1 if first and last else 2 if first or last else 3
    stage = 0 if first else num_stages - 1 if last else 1
    runtime = PipelineStage(
        specs,
        stage=stage,
        layers=range(len(specs)),
        num_stages=num_stages,
        seed=0,
        device=next(module.parameters()).device,
        precision=shape.precision,
        recompute=shape.recompute,
        built=module,
        tp_mesh=tp_mesh,
        sequence_parallel=shape.sequence_parallel and tp_mesh is not None,
    )
    if tp_mesh is not None:
        # the split made each layer its own, as in the engine; a measured stage's layers
        # carry global indices
        share_local_ties(dict(zip(module.indices, specs, strict=True)), [module])
    return runtime


class StageRun:
    """One stage's side of a training step, as `engine._Step` runs it.

    F receives its input into a new buffer (the first stage slices the step's token batch);
    B and I receive the output gradient into a new buffer. A stage's output sent forward is
    released once its gradient has arrived (RECV_B: the peer used it), an input gradient sent
    back when the schedule proves it delivered (`release_sent`, at the receive
    `engine.schedule.delivery.released_at` names), and what is left at the step's end.
    Gradients start the step as None, as `train_step` sets them. `split` names the
    micro-batches whose backward is I + W (the engine's `split_units`); others run a fused B.
    `local_in` / `local_out`: the previous / next stage lives on the same rank (V placement),
    so what crosses that edge is handed over in memory, not held as a send until the step's
    end; the receiving side allocates it, as for a receive. `tp_mesh`: the layers are split
    over it with DTensor plans, as the engine splits them (a measured run).
    """

    def __init__(
        self,
        module: LayerStack,
        specs: Sequence[LayerSpec],
        *,
        first: bool,
        last: bool,
        split: frozenset[int],
        shape: StageShape,
        local_in: bool = False,
        local_out: bool = False,
        tp_mesh: DeviceMesh | None = None,
    ) -> None:
        self.stage = _runtime_stage(
            module, specs, first=first, last=last, shape=shape, tp_mesh=tp_mesh
        )
        self.local_in, self.local_out = local_in, local_out
        if split:
            self.stage.enable_split_backward()
        self.shape, self.first, self.last, self.split = shape, first, last, split
        self.device = next(module.parameters()).device
        self.sent: dict[int, list[torch.Tensor]] = {}
        """Each micro-batch's input gradients sent back, until proved delivered."""
        self.sent_forward: dict[int, list[torch.Tensor]] = {}
        """Each in-flight micro-batch's output sent forward, until its gradient arrives."""
        self.sends_copied = False
        """Whether a tensor sent was not contiguous, so that the send held a copy of it, not
        the tensor itself (`trace_store.with_local_edges` then cannot derive a local edge)."""
        self.losses: list[torch.Tensor] = []
        self._tokens = self._targets = torch.empty(0)
        scaler = LossScaler() if shape.precision == "fp16" else None
        self._loss_scale = scaler.scale if scaler is not None else 1.0

    def begin(self) -> None:
        """The step starts: gradients are None; the batch arrives (token ids, targets)."""
        for param in self.stage.module.parameters():
            param.grad = None
        size = (self.shape.micro_batches * self.shape.micro_batch_size, self.shape.seq_len)
        if self.first:
            self._tokens = torch.zeros(size, dtype=torch.long, device=self.device)
        if self.last:
            self._targets = torch.zeros(size, dtype=torch.long, device=self.device)

    def act(self, action: Action) -> None:
        k, kind = action.micro_batch, action.kind
        if kind is ActionKind.F:
            self._forward(k)
        elif kind is ActionKind.W:
            self.stage.backward_weight(k)
        else:
            grads = () if self.last else (self._received(requires_grad=False),)
            self.sent_forward.pop(k, None)
            backward = self.stage.backward_input if kind is ActionKind.I else self.stage.backward
            input_grads = backward(k, grads)
            if not self.local_in:
                self.sent[k] = self._payload(input_grads)

    def release_sent(self, k: int) -> None:
        """Micro-batch `k`'s input gradients reached the previous stage: they are dropped."""
        del self.sent[k]

    def held_bytes(self, block: int) -> int:
        """Bytes of what the step keeps for now: sent tensors and losses."""
        return _bytes(
            [t for sent in (*self.sent.values(), *self.sent_forward.values()) for t in sent]
            + self.losses,
            block,
        )

    def sent_bytes(self, k: int, block: int) -> int:
        """Bytes of micro-batch `k`'s input gradients sent back (none held: 0)."""
        return _bytes(self.sent.get(k, []), block)

    def finish(self) -> None:
        """The step's end: sends are awaited, the step's losses dropped."""
        self.sent.clear()
        self.sent_forward.clear()
        self.losses.clear()

    def _forward(self, k: int) -> None:
        x = self._micro(self._tokens, k) if self.first else self._received(requires_grad=True)
        outputs = self.stage.forward(
            k,
            (x,),
            targets=self._micro(self._targets, k) if self.last else None,
            loss_divisor=self.shape.divisor,
            loss_scale=self._loss_scale,
            split=k in self.split,
        )
        if self.last:
            self.losses.append(outputs[0])
        elif not self.local_out:
            self.sent_forward[k] = self._payload(outputs)

    def _payload(self, tensors: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
        if not all(t.is_contiguous() for t in tensors):
            self.sends_copied = True
        return [t.detach() if t.is_contiguous() else t.detach().contiguous() for t in tensors]

    def _micro(self, batch: torch.Tensor, k: int) -> torch.Tensor:
        """Micro-batch `k` of the step's batch; the trace runs two micro-batches per backward
        style whatever the step's count, so with fewer it wraps around (same shapes)."""
        size = self.shape.micro_batch_size
        start = (k % self.shape.micro_batches) * size
        return batch[start : start + size]

    def _received(self, *, requires_grad: bool) -> torch.Tensor:
        shape = (self.shape.micro_batch_size, self.shape.boundary_seq_len, self.shape.hidden)
        dtype = compute_dtype(self.shape.precision)
        return torch.empty(shape, dtype=dtype, device=self.device).requires_grad_(requires_grad)


def _bytes(tensors: list[torch.Tensor], block: int) -> int:
    """Bytes of the distinct storages under `tensors`, each rounded to the allocator's block."""
    held = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in tensors}
    return sum(round_up(n, block) for n in held.values())


def backward_styles(actions: Sequence[Action]) -> tuple[bool, ...]:
    """A stage's backward styles in order of first appearance: `False` for fused B, `True`
    for I + W; both where a schedule mixes them (zb_drain), none for forwards only."""
    styles = [a.kind is ActionKind.I for a in actions if a.kind in (ActionKind.B, ActionKind.I)]
    return tuple(dict.fromkeys(styles))


def local_edges(schedule: Schedule, stage: int) -> tuple[bool, bool]:
    """Whether the stage's previous and next stage live on its rank (their hand-off stays in
    memory): stages P - 1 and P of the V placement."""
    rank, last = schedule.rank_of(stage), schedule.num_stages - 1
    return (
        stage > 0 and schedule.rank_of(stage - 1) == rank,
        stage < last and schedule.rank_of(stage + 1) == rank,
    )


def stage_actions(schedule: Schedule, stage: int) -> list[Action]:
    """The stage's compute actions in its rank's order (what its replay runs)."""
    row = schedule.rows[schedule.rank_of(stage)]
    return [a for a in row if a.stage == stage and a.is_compute]


def in_flight(actions: Sequence[Action]) -> int:
    """Most micro-batches holding a stash at once: F opens one, B or W closes it."""
    live = peak = 0
    for action in actions:
        if action.kind is ActionKind.F:
            live += 1
            peak = max(peak, live)
        elif action.kind in (ActionKind.B, ActionKind.W):
            live -= 1
    return peak


def rank_events(
    schedule: Schedule,
    stages: Sequence[int],
    releases: Mapping[Action, tuple[Action, ...]] | None = None,
) -> list[Action]:
    """What a replay of the rank holding `stages` runs, in its row's order: their compute
    actions, and the receives that free input gradients they sent back (`sends_released`,
    worked out here unless given)."""
    if releases is None:
        releases = sends_released(schedule, stages)
    mine = frozenset(stages)
    row = as_lowered(schedule).rows[schedule.rank_of(stages[0])]
    return [a for a in row if (a.kind in COMPUTE_KINDS and a.stage in mine) or a in releases]


def sends_released(schedule: Schedule, stages: Sequence[int]) -> dict[Action, tuple[Action, ...]]:
    """For each receive of the rank's row, the input gradients of `stages` it proves delivered.

    Outputs sent forward are released at their stage's backward (`StageRun.act`: the RECV_B
    right before it proves them delivered)."""
    rank = schedule.rank_of(stages[0])
    every = _sent_back_released(schedule, rank)
    if set(stages) >= set(schedule.stages_of(rank)):
        return dict(every)
    releases = {recv: tuple(a for a in sends if a.stage in stages) for recv, sends in every.items()}
    return {recv: sends for recv, sends in releases.items() if sends}


@functools.lru_cache(maxsize=256)
def _sent_back_released(schedule: Schedule, rank: int) -> dict[Action, tuple[Action, ...]]:
    """`released_at` of the rank, its input gradients sent back (SEND_B) alone: a replay asks
    it of each stage and each rank."""
    releases = {
        recv: tuple(a for a in sends if a.kind is ActionKind.SEND_B)
        for recv, sends in released_at(schedule, rank).items()
    }
    return {recv: sends for recv, sends in releases.items() if sends}
