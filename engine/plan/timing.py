"""Step time of a candidate layout: per-stage action costs and communication, then the simulator.

Compute: a layer's forward is its FLOPs (`LayerSpec.forward_flops`, split `tp` ways) at the
device's achieved rate, or its time measured here (`--profile`); a backward is twice a
forward, and full recompute adds a forward to each backward. A split backward's W is the
weight GEMMs of the layer's Linears (as many FLOPs as their forward) and its I the rest
(`input_share`; measured with `--profile`), except where the engine runs a stage's whole
backward at I: a stage that recomputes, or holds both ends of a tied weight.

Communication, from message sizes and the `Hardware` bandwidths:
- tensor parallelism: as DTensor's plans run them (`tp_all_reduces`), in each forward an
  all-reduce of a hidden state per row-wise Linear and vocabulary-split embedding, and three of
  per-token scalars for a vocabulary-split head's loss; in each backward one per input that
  column-wise Linears read (q, k and v share one) and one for the head's input;
- pipeline: each boundary's activation (split `tp` ways along the sequence), the simulator's
  send-to-receive delay;
- data parallelism, after a rank's last backward: the fp32 gradient all-reduce (ZeRO-0/1),
  reduce-scatter (ZeRO-2/3), then the updated weights all-gathered (ZeRO-1/2) or, under ZeRO-3,
  the compute-dtype gather of every layer once per step (or per forward and backward,
  resharded per micro-batch, with a reduce-scatter per backward).
The step is the latest rank's simulated end plus its data-parallel tail.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from torch import nn

from engine.plan.hardware import Hardware, all_reduce_time
from engine.runtime.weight_grads import runs_whole_backward_at_input
from engine.schedule import (
    ActionCosts,
    Program,
    Schedule,
    SimResult,
    SimTimes,
    shared_program_times,
    shared_timeline,
    simulate,
)
from models import LayerSpec

__all__ = [
    "StageTimes",
    "Timed",
    "TpAllReduces",
    "dp_tail",
    "input_share",
    "layer_flops",
    "simulate_stages",
    "stage_times",
    "stages_timeline",
    "time_program",
    "tp_all_reduces",
    "with_tails",
]


@functools.lru_cache(maxsize=4096)
def layer_flops(spec: LayerSpec, seq_len: int) -> int:
    """Forward FLOPs of one sequence through the layer."""
    return spec.forward_flops(1, seq_len)


@functools.lru_cache(maxsize=4096)
def input_share(spec: LayerSpec, seq_len: int) -> float:
    """Of the layer's backward, the share a split backward runs at I, by FLOPs. W is the
    weight GEMM of each Linear (gᵀ·x: as many FLOPs as its forward GEMM); I is the rest: the
    input GEMMs, and attention's backward (its scores have no weights, so a block's I is more
    than half) and the norms'. Under tensor parallelism both split alike."""
    forward = layer_flops(spec, seq_len)
    if forward <= 0:
        return 1.0
    module = spec.build("meta")
    weights = sum(m.weight.numel() for m in module.modules() if isinstance(m, nn.Linear))
    return min(1.0, max(0.0, 1 - seq_len * weights / forward))


class TpAllReduces(NamedTuple):
    """All-reduces one tensor-parallel micro-batch of a layer runs, as the engine's DTensor
    plans run them without sequence parallelism, which the planner does not choose (counted
    with torch's `CommDebugMode` in tests/unit/test_plan_tp_comm.py)."""

    forward: int
    """Of a hidden state: one per row-wise Linear (its partial sums) and per vocabulary-split
    embedding."""
    backward: int
    """Of a hidden state: the gradient of each replicated input of column-wise Linears, one
    per module whose Linears share it (`shared_input`: q, k and v together), one per
    column-wise Linear outside such a module, and the vocabulary-split head's input."""
    loss: int
    """Of per-token scalars, in the forward: a vocabulary-split head's loss (the logits' max,
    the sum of their exponentials and the target's logit)."""


@functools.lru_cache(maxsize=4096)
def tp_all_reduces(spec: LayerSpec) -> TpAllReduces:
    plan: dict[str, str] = getattr(spec.module_cls, "tp_plan", {})
    shared = [name for name, role in plan.items() if role == "shared_input"]
    alone = [
        name
        for name, role in plan.items()
        if role == "colwise" and not any(name.startswith(s + ".") for s in shared)
    ]
    roles = list(plan.values())
    heads = roles.count("vocab_head")
    return TpAllReduces(
        forward=roles.count("rowwise") + roles.count("vocab_embedding"),
        backward=len(shared) + len(alone) + heads,
        loss=3 * heads,
    )


@dataclass(frozen=True, kw_only=True)
class StageTimes:
    """Seconds of one stage's actions and of what its rank communicates."""

    forward: float
    backward: float
    input_grad: float
    weight_grad: float
    tp_comm: float
    """Of the forward plus backward: tensor-parallel all-reduces."""
    recompute: float
    """Of the backward: the forward it runs again."""
    waits: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0)
    """Of F, B, I and W: seconds in collectives (tp all-reduces, ZeRO-3's per-micro-batch
    gathers and reduce-scatters), which a host's shared cores do not slow
    (`shared_program_times`)."""


def stage_times(
    forward: Sequence[float],
    specs: Sequence[LayerSpec],
    layers: range,
    *,
    hardware: Hardware,
    activation_bytes: float,
    tp: int,
    recompute: bool,
    input_shares: Sequence[float],
    zero_turn: tuple[float, float] = (0.0, 0.0),
) -> StageTimes:
    """`forward[i]`: seconds of layer i's forward on one device (already split `tp` ways);
    `input_shares[i]`: of its backward, the share a split backward runs at I
    (`input_share`); `activation_bytes`: one micro-batch's hidden state; `zero_turn`: ZeRO-3
    resharded per micro-batch, the gather before each forward and the gather plus gradient
    reduce-scatter around each backward."""
    f = sum(forward[i] for i in layers)
    tp_f, tp_b = _tp_seconds(specs[layers.start : layers.stop], activation_bytes, tp, hardware)
    extra = f + tp_f if recompute else 0.0
    weight = 0.0
    if not runs_whole_backward_at_input(specs, layers, "full" if recompute else "none"):
        weight = sum(2 * forward[i] * (1 - input_shares[i]) for i in layers)
    backward_waits = tp_b + (tp_f if recompute else 0.0) + zero_turn[1]
    return StageTimes(
        forward=f + tp_f + zero_turn[0],
        backward=2 * f + tp_b + extra + zero_turn[1],
        input_grad=2 * f - weight + tp_b + extra + zero_turn[1],
        weight_grad=weight,
        tp_comm=tp_f + tp_b,
        recompute=extra,
        waits=(tp_f + zero_turn[0], backward_waits, backward_waits, 0.0),
    )


def _tp_seconds(
    specs: Sequence[LayerSpec], activation_bytes: float, tp: int, hardware: Hardware
) -> tuple[float, float]:
    """Seconds of the stage's tensor-parallel all-reduces in a forward and in a backward
    (the loss's per-token scalars priced at the latency alone: a hidden state's 1/d_model)."""
    if tp <= 1:
        return 0.0, 0.0
    counts = [tp_all_reduces(spec) for spec in specs]
    bw, latency = hardware.link_bandwidth, hardware.latency
    hidden = all_reduce_time(activation_bytes, tp, bw, latency)
    scalars = all_reduce_time(0.0, tp, bw, latency)
    forward = sum(c.forward for c in counts) * hidden + sum(c.loss for c in counts) * scalars
    return forward, sum(c.backward for c in counts) * hidden


def dp_tail(
    params: float, *, size: int, dp: int, zero: int, reshard: str, hardware: Hardware, width: int
) -> float:
    """Seconds of a rank's data-parallel work after its last backward, for `params`
    parameters: fp32 gradients, weights gathered in the compute dtype (`size` bytes each);
    the replica group spans `width` consecutive global ranks."""
    bandwidth, latency = hardware.bandwidth(width), hardware.latency
    grads, param_bytes = 4 * params, size * params
    if zero == 0:
        return all_reduce_time(grads, dp, bandwidth, latency)
    gather = hardware.all_gather(param_bytes, dp, width)
    if zero == 1:
        return all_reduce_time(grads, dp, bandwidth, latency) + gather
    if zero == 3 and reshard == "micro-batch":
        return 0.0
    return hardware.reduce_scatter(grads, dp, width) + gather


@dataclass(frozen=True, kw_only=True)
class Timed:
    """A simulated step: its time and bubble with each rank's data-parallel tail, and the
    sample's busy time (`SimTimes`)."""

    step: float
    bubble: float
    busy: float


def _costs(stages: Sequence[StageTimes], p2p: float) -> ActionCosts:
    return ActionCosts(
        per_stage=tuple((s.forward, s.backward, s.input_grad, s.weight_grad) for s in stages),
        comm=p2p,
    )


def simulate_stages(
    schedule: Schedule, stages: Sequence[StageTimes], *, p2p: float, validated: bool = False
) -> SimResult:
    """The schedule's step under the stages' action costs and the transfer delay `p2p`
    (`validated`: as `simulate`'s), with its timeline."""
    return simulate(schedule, _costs(stages, p2p), validated=validated)


def stages_timeline(
    lowered: Schedule, stages: Sequence[StageTimes], *, p2p: float, slots: float = math.inf
) -> SimResult:
    """`simulate_stages` of a lowered schedule known valid, its ranks on `slots` CPU cores
    each as `time_program` times them (`shared_timeline`): the timeline a plan's figure
    draws shows the step the search priced."""
    waits = tuple(s.waits for s in stages)
    return shared_timeline(lowered, _costs(stages, p2p), slots, waits)


def time_program(
    program: Program, stages: Sequence[StageTimes], *, p2p: float, slots: float = math.inf
) -> SimTimes | None:
    """The ends and busy times of a generator's schedule, compiled (`compiled_program`),
    under the stages' action costs and the transfer delay `p2p`, as `simulate_stages` would
    time it without its timeline: what the search prices every candidate by. None where it
    stalls (a deadlock, which `simulate_stages` of the schedule explains). `slots`: the CPU
    cores each pipeline rank's share of the host comes to, where its ranks share fewer cores
    than they number (`Hardware.host_cores`; `shared_program_times`)."""
    waits = tuple(s.waits for s in stages)
    return shared_program_times(program, _costs(stages, p2p), len(stages), slots, waits)


def with_tails(times: SimTimes, tails: Sequence[float]) -> Timed:
    """The step with each rank's data-parallel tail added after its last action."""
    step = max(end + tail for end, tail in zip(times.ends, tails, strict=True))
    busy = sum(times.busy)
    bubble = 1 - busy / (len(times.ends) * step) if step > 0 else 0.0
    return Timed(step=step, bubble=bubble, busy=busy)
