"""Model states of a stage under ZeRO-1/2/3, from parameter shapes and the way
`engine.parallel` lays them out.

ZeRO-1/2 (Megatron's distributed optimizer, `engine.parallel.zero`): one flat buffer per
optimizer group (decay, no decay) and dtype, padded to a multiple of dp. Under bf16/fp16 the
Linears' weights live only in the compute dtype (2 bytes), the rest stay fp32; every gradient
accumulates in an fp32 buffer the size of the whole flat (4 bytes); each replica keeps its
1/dp shard of the fp32 masters (the narrow flats only: an fp32 flat is its own master) and of
AdamW's two moments. ZeRO-2 keeps only its gradient shard between steps; while the step's
backwards accumulate, the whole fp32 buffer exists as under ZeRO-1.

ZeRO-3 (FSDP2, `engine.parallel.fsdp`): every parameter an fp32 shard along its first
dimension (padded to a multiple of dp), AdamW's moments likewise; each step gathers every
layer in the compute dtype and keeps it gathered, and gradients accumulate unsharded in fp32
until the stage's last backward reduce-scatters them. Resharded per micro-batch
(`--zero-reshard micro-batch`), a layer is gathered only for its forward or backward and its
gradient reduce-scattered after each backward into the fp32 shard.

Bytes per parameter at bf16 and dp 8, weights + gradients + optimizer: ZeRO-1 2 + 4 + 12/8 =
7.5 (Megatron's distributed optimizer, the same formula); ZeRO-2 the same during the step,
2 + 0.5 + 1.5 = 4 between steps; ZeRO-3 16/8 = 2 between steps, plus the gathered layers
(2) and their unsharded gradients (4) during it, or, resharded per micro-batch, 2 during it as
well plus one layer's turn.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine.memory.states import ParamInfo, StateLayout
from engine.memory.tracker import Span, round_up

__all__ = ["ShardedStates", "fsdp_step_peak", "sharded_states", "sharded_step_peak"]


@dataclass(frozen=True, kw_only=True)
class ShardedStates:
    """What one replica of a stage holds under a ZeRO level, in bytes."""

    weights: int
    """Kept across steps: the working weights (ZeRO-1/2) or the fp32 shards (ZeRO-3)."""
    gradients: int
    """The fp32 gradients while the step accumulates (the whole buffer, or unsharded)."""
    optimizer: int
    """Kept across steps: this replica's fp32 masters and AdamW moments (and step counters)."""
    gathered: int
    """ZeRO-3: the compute-dtype copies of every layer, gathered once per step; or, resharded
    per micro-batch, what the largest turn holds beyond its layer's trace (`_one_turn`)."""


def _flats(params: Sequence[ParamInfo], narrow: bool) -> list[tuple[int, bool]]:
    """(elements, kept narrow) of each flat buffer: per optimizer group, narrow then fp32."""
    flats = []
    for decay in (True, False):
        group = [p for p in params if p.decay == decay]
        for kind in (True, False) if narrow else (False,):
            numel = sum(p.numel for p in group if (p.cast and narrow) == kind)
            if numel:
                flats.append((numel, kind))
    return flats


def sharded_states(
    params: Sequence[ParamInfo], states: StateLayout, *, precision: str
) -> ShardedStates:
    """A replica's states of `params` under `states.zero` (1, 2 or 3)."""
    dp, block = states.dp, states.block
    size = 4 if precision == "fp32" else 2
    step = round_up(4, block) if states.step_counters else 0
    if states.zero == 3:
        shards = [_fsdp_shard(p, dp) for p in params]
        per_micro_batch = states.zero_reshard == "micro-batch"
        return ShardedStates(
            weights=sum(round_up(4 * n, block) for n in shards),
            gradients=sum(
                round_up(4 * (n if per_micro_batch else p.numel), block)
                for n, p in zip(shards, params, strict=True)
            ),
            optimizer=sum(2 * round_up(4 * n, block) + step for n in shards),
            gathered=_one_turn(params, size, block)
            if per_micro_batch
            else sum(round_up(size * p.numel, block) for p in params),
        )
    weights = gradients = optimizer = 0
    for numel, narrow in _flats(params, precision != "fp32"):
        padded = -(-numel // dp) * dp
        shard = padded // dp
        weights += round_up((size if narrow else 4) * padded, block)
        gradients += round_up(4 * padded, block)
        masters = round_up(4 * shard, block) if narrow else 0
        optimizer += masters + 2 * round_up(4 * shard, block) + step
    return ShardedStates(weights=weights, gradients=gradients, optimizer=optimizer, gathered=0)


def _fsdp_shard(param: ParamInfo, dp: int) -> int:
    """Elements of one replica's FSDP2 shard: dim 0 padded to a multiple of dp, then split."""
    return -(-param.rows // dp) * (param.numel // max(param.rows, 1))


def _one_turn(params: Sequence[ParamInfo], size: int, block: int) -> int:
    """Resharded per micro-batch, what the largest turn holds beyond its layer's own trace
    (the planner's screen; the estimate traces FSDP itself): the layer's gather and gradient
    reduction are in that trace (`engine.plan.layer_bytes` traces layers under FSDP), the next
    layer FSDP prefetches is not. Against the replay, the screen of gpt-small at pp 2-4, dp
    2-4 reads 7-13 % high with this, 27-58 % with each layer's whole turn summed."""
    layers: dict[int, int] = {}
    for p in params:
        layers[p.layer] = layers.get(p.layer, 0) + round_up(p.numel * size, block)
    return max(layers.values(), default=0)


def fsdp_step_peak(
    params: Sequence[ParamInfo],
    layout: StateLayout,
    *,
    peak: int,
    live_end: int,
    held: int,
    reduces: Sequence[Span],
) -> int:
    """ZeRO-3: the step's peak above the kept shards, from the FSDP replay of the row.

    The replay ran FSDP2 itself (`traces.trace_stage`): its gathers, compute-dtype gradients
    and their fp32 accumulation are in `peak`. After the schedule each stage reduce-scatters
    its layers' gradients into their shards and reshards (`reduces`, traced; nothing where
    each backward did so) while the sends are held; then AdamW steps the shards, its
    temporaries the size of the largest one.
    """
    live = live_end
    for span in reduces:
        peak = max(peak, live + span.peak)
        live += span.net
    dp, block = layout.dp, layout.block
    largest = max((_fsdp_shard(p, dp) for p in params), default=0)
    return max(peak, live - held + layout.temporaries * round_up(4 * largest, block))


def sharded_step_peak(
    states: ShardedStates,
    layout: StateLayout,
    params: Sequence[ParamInfo],
    *,
    peak: int,
    live_end: int,
    held: int,
    cached: int,
    precision: str,
) -> int:
    """ZeRO-1/2: the step's peak above the kept states, from the zero-0 replay of the same row.

    The replay casts each Linear weight once per step (`cached` bytes) and allocates fp32
    gradients as backwards arrive. ZeRO-1/2 keep those weights in the compute dtype already:
    no copies. After the schedule: ZeRO-1 all-reduces its buffers in place; ZeRO-2 posts
    every buffer's reduce-scatter into a shard-sized output while the sends are still held,
    then drops the whole buffers before the step; the optimizer's per-tensor temporaries are
    shard-sized.
    """
    block = layout.block
    copies = cached if precision != "fp32" else 0
    flats = _flats(params, precision != "fp32")
    shards = [-(-numel // layout.dp) for numel, _ in flats]
    temporaries = layout.temporaries * round_up(4 * max(shards, default=0), block)
    if layout.zero == 2 and layout.dp > 1:
        # every reduce-scatter is posted at once, into shard-sized outputs, while the sends
        # are held; once they complete the whole buffers go and the shards step
        scattered = sum(round_up(4 * n, block) for n in shards)
        reducing = live_end - cached + scattered
        after = live_end - held - cached - states.gradients + scattered + temporaries
        return max(peak - copies, reducing, after)
    after = live_end - held - cached + temporaries
    return max(peak - copies, after)
