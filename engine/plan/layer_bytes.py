"""Per-layer bytes the planner's memory screen composes (`engine.plan.budget`).

Each distinct layer is traced once on fake tensors (`engine.memory.fitting.layer_sums`, one
sequence per micro-batch: what a forward keeps, its weight copies, its highest transient, all
proportional to the micro-batch size; under a split backward also what it holds awaiting W),
and its model states follow from its parameter shapes under the ZeRO level
(`engine.memory.sharding`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import NamedTuple

import numpy as np

from engine.memory.fitting import layer_sums
from engine.memory.replay import StageShape
from engine.memory.sharding import sharded_states
from engine.memory.states import StateLayout, stage_params
from engine.memory.tracker import CUDA_BLOCK, round_up
from models import LayerSpec

__all__ = ["LayerArrays", "LayerBytes", "layer_bytes", "layer_shape", "state_sums"]


@dataclass(frozen=True, kw_only=True)
class LayerBytes:
    """Per layer, bytes for one sequence per micro-batch (activations) or one replica (states)."""

    kept: tuple[int, ...]
    """What one forward keeps until its backward, less the input the stage received."""
    transient: tuple[int, ...]
    received: int
    """The input a stage receives per sequence, in the compute dtype it is sent in (what full
    recompute keeps)."""
    residual: int
    """A hidden state per sequence as it passes between two layers of one stage: fp32 (the
    stage widens what it receives, `Stage._widened_run`), where `received` is in the compute
    dtype; two layers traced alone count it twice (`budget._shared_per_stage`)."""
    weights: tuple[int, ...]
    """Kept across steps, with the optimizer's states."""
    gradients: tuple[int, ...]
    during: tuple[int, ...]
    """Step-long copies: autocast's weight casts, or ZeRO-3's gathered layers."""
    turn: tuple[int, ...]
    """ZeRO-3 resharded per micro-batch: what a turn of this layer holds beyond its FSDP
    trace (the next layer's prefetch, `engine.memory.sharding._one_turn`). A stage holds its
    largest, not their sum: one layer turns at a time."""
    fused_kept: tuple[int, ...]
    fused_transient: tuple[int, ...]
    """`kept` and `transient` before a fused backward: a split schedule's stages that run
    no I (ZB-H1's first) keep these; the same as `kept` and `transient` where not split."""
    awaiting_w: tuple[int, ...]
    """What a split micro-batch holds from its I to its W (`LayerSums.awaiting_w`)."""
    gradients_first: bool = False
    """ZeRO-1/2: the gradients live in flat fp32 buffers kept across steps
    (`ShardedOptimizer`), so a stage holds them from its step's start, beside every stash it
    reaches before its first backward too (as the replay counts them, `compose`)."""

    @functools.cached_property
    def least(self) -> LayerBytes:
        """Each layer's least stash of the two backward styles and of a split one's two
        halves, and lesser transient: what floors, which know no stage's style nor when its
        W runs, bound from below."""
        kept = tuple(map(min, self.kept, self.fused_kept, self.awaiting_w))
        transient = tuple(map(min, self.transient, self.fused_transient))
        return replace(
            self,
            kept=kept,
            transient=transient,
            fused_kept=kept,
            fused_transient=transient,
            awaiting_w=kept,
        )

    @functools.cached_property
    def arrays(self) -> LayerArrays:
        """The fields as arrays: a stage's sum of each is one difference of prefix sums (the
        screen sums stages hundreds of thousands of times), its largest one `reduceat`."""

        def prefix(values: tuple[int, ...] | np.ndarray) -> np.ndarray:
            return np.concatenate([[0], np.cumsum(values, dtype=np.int64)])

        def each(values: tuple[int, ...]) -> np.ndarray:
            return np.asarray(values, dtype=np.int64)

        return LayerArrays(
            fixed_sums=prefix(np.add(self.weights, self.during, dtype=np.int64)),
            grad_sums=prefix(self.gradients),
            kept_sums=prefix(self.kept),
            fused_sums=prefix(self.fused_kept),
            awaiting_sums=prefix(self.awaiting_w),
            kept=each(self.kept),
            transient=each(self.transient),
            turn=each(self.turn),
            fused_transient=each(self.fused_transient),
        )


class LayerArrays(NamedTuple):
    """`LayerBytes` as arrays: prefix sums over the layers (`*_sums`; the fixed ones are the
    weights with their step-long copies), and per-layer values."""

    fixed_sums: np.ndarray
    grad_sums: np.ndarray
    kept_sums: np.ndarray
    fused_sums: np.ndarray
    awaiting_sums: np.ndarray
    kept: np.ndarray
    transient: np.ndarray
    turn: np.ndarray
    fused_transient: np.ndarray


_TRACED_REPLICAS = 2
"""ZeRO-3's layers are traced under FSDP on a fake world of this many replicas, whatever the
candidate's dp: what a layer's forward keeps and its transients do not depend on the replica
count beyond the shards' padding, and one trace per layer serves every dp the search weighs
(`meshpipe memory` replays the chosen plan at its own dp exactly)."""


@functools.lru_cache(maxsize=64)
def layer_bytes(
    specs: tuple[LayerSpec, ...],
    *,
    seq_len: int,
    precision: str,
    device: str,
    tp: int,
    split: bool,
    states: StateLayout,
) -> LayerBytes:
    """Each layer's bytes, its activations traced at one sequence per micro-batch."""
    shape = layer_shape(specs, seq_len=seq_len, precision=precision, tp=tp, states=states)
    sums = layer_sums(specs, shape, device, 1, (split,))
    fused = layer_sums(specs, shape, device, 1, (False,)) if split else sums
    block = CUDA_BLOCK if device == "cuda" else 1
    size = 4 if precision == "fp32" else 2
    own = [_layer_states(spec, states, precision) for spec in specs]
    copies = sums.copies if states.zero == 0 else tuple(c for _, _, c in own)
    turns = _per_micro_batch(states)
    return LayerBytes(
        kept=sums.kept,
        transient=sums.transient,
        received=round_up(seq_len * shape.hidden * size, block),
        residual=round_up(seq_len * shape.hidden * 4, block),
        weights=tuple(w for w, _, _ in own),
        gradients=tuple(g for _, g, _ in own),
        during=(0,) * len(specs) if turns else copies,
        turn=copies if turns else (0,) * len(specs),
        fused_kept=fused.kept,
        fused_transient=fused.transient,
        awaiting_w=sums.awaiting_w,
        gradients_first=states.zero in (1, 2),
    )


def _per_micro_batch(states: StateLayout) -> bool:
    """ZeRO-3 gathering each layer per turn: its copies are the largest turn, not a sum."""
    return states.zero == 3 and states.zero_reshard == "micro-batch"


def layer_shape(
    specs: Sequence[LayerSpec], *, seq_len: int, precision: str, tp: int, states: StateLayout
) -> StageShape:
    """The shape `layer_bytes` traces each layer at: one sequence, one micro-batch."""
    return StageShape(
        micro_batches=1,
        micro_batch_size=1,
        seq_len=seq_len,
        hidden=int(specs[0].config.d_model),
        divisor=1,
        precision=precision,
        recompute="none",
        tp=tp,
        fsdp_replicas=_TRACED_REPLICAS if states.zero == 3 else 0,
        fsdp_reshard=states.zero_reshard,
    )


@functools.lru_cache(maxsize=4096)
def _layer_states(spec: LayerSpec, states: StateLayout, precision: str) -> tuple[int, int, int]:
    """(weights + optimizer, gradients, step-long copies) of one layer on one replica."""
    params = stage_params((spec,), states.tp)
    if states.zero:
        sharded = sharded_states(params, states, precision=precision)
        return sharded.weights + sharded.optimizer, sharded.gradients, sharded.gathered
    fp32 = sum(round_up(4 * p.numel, states.block) for p in params)
    step = round_up(4, states.block) if states.step_counters else 0
    optimizer = sum(2 * round_up(4 * p.numel, states.block) + step for p in params)
    return fp32 + optimizer, fp32, 0


def state_sums(
    specs: Sequence[LayerSpec], states: StateLayout, precision: str
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Prefix sums over the layers of (weights, optimizer and ZeRO-3's step-long gathered
    copies) and of gradients, from parameter shapes alone: a floor of a stage's peak without a
    trace (a per-micro-batch turn, one layer's, is left out)."""
    fixed, grads = [0], [0]
    step_long = states.zero == 3 and not _per_micro_batch(states)
    for spec in specs:
        weights, gradients, gathered = _layer_states(spec, states, precision)
        fixed.append(fixed[-1] + weights + (gathered if step_long else 0))
        grads.append(grads[-1] + gradients)
    return tuple(fixed), tuple(grads)
