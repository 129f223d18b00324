"""`--partition memory`: the fastest split of the model whose every stage fits the device.

Per layer, the memory model's own sums, each layer traced once on fake tensors: its model
states, what one forward keeps until its backward, and its low-precision weight copies. Per
stage, the schedule's counts: micro-batches in flight (1F1B's stage s holds P − s) and those
still held once its gradients exist. A stage's bytes are what `memory_balanced` weighs; its
time is its layers' FLOPs (a backward costs a fixed multiple of its forward, so FLOPs rank
stages as forward plus backward does). `partitioners.fastest_fitting` finds the split with
the smallest slowest stage among those whose every stage fits.

On top of what is held, the highest transient of any one of the stage's layers (one action
runs at a time). The sums leave out what a stage holds once however many layers it has (the
input it received, the buffers of its sends, a split backward's pending weight gradients), so
`estimate_memory` replays the chosen split exactly, adds what the sums missed per stage and
chooses again until the replay agrees (`engine.memory.estimate`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import accumulate

from engine.memory.replay import StageShape, backward_styles, in_flight, stage_actions
from engine.memory.states import dp_bucket_copy, stage_params
from engine.memory.trace_store import TraceRequest, cached_trace
from engine.memory.tracker import CUDA_BLOCK, round_up
from engine.schedule.actions import Action, ActionKind
from engine.schedule.schedule import Schedule
from models import LayerSpec
from partitioners import Partition, StageFits, fastest_fitting, min_bottleneck
from partitioners.costs import flop_costs

__all__ = [
    "LayerSums",
    "fitting_partition",
    "held_with_gradients",
    "layer_requests",
    "layer_sums",
    "least_memory_partition",
    "stage_bytes",
    "stage_needs",
]


@dataclass(frozen=True, kw_only=True)
class LayerSums:
    """Per layer of the model, bytes as the memory model counts them."""

    states: tuple[int, ...]
    """fp32 weights and AdamW's two states (their share of them under ZeRO)."""
    grads: tuple[int, ...]
    """fp32 gradients, which exist from the stage's first backward."""
    kept: tuple[int, ...]
    """What one forward keeps until its backward, less the input the stage received."""
    copies: tuple[int, ...]
    """Its low-precision weight copies: one per step, whatever is in flight."""
    transient: tuple[int, ...]
    """The highest any one of its actions rises above where it started (the head's logits
    and their gradient, an attention's scores): one layer at a time, on top of what is held."""
    awaiting_w: tuple[int, ...] = ()
    """Split backwards: what one micro-batch holds from its I to its W, which frees it all
    (the Linears' inputs and output gradients, under autocast the graph W runs through, the
    layer's input too); `kept` where the backward is fused."""


@functools.lru_cache(maxsize=16)
def layer_sums(
    specs: tuple[LayerSpec, ...],
    shape: StageShape,
    device: str,
    shards: int = 1,
    styles: tuple[bool, ...] = (False,),
) -> LayerSums:
    """Each layer traced alone (as stage 0 when it is the first layer, as the last stage when
    it is the last), so layers built alike are traced once; AdamW's states split `shards` ways
    (ZeRO-1 over the data-parallel replicas); backwards fused or split as `styles` says
    (`replay.backward_styles`: a forward before a split backward keeps other tensors)."""
    block = CUDA_BLOCK if device == "cuda" else 1
    size = 4 if shape.precision == "fp32" else 2
    received = round_up(
        shape.micro_batch_size * shape.boundary_seq_len * shape.hidden * size, block
    )
    states, grads, kept, copies, transient, awaiting = [], [], [], [], [], []
    for i, request in enumerate(layer_requests(specs, shape, device, styles)):
        fp32 = sum(round_up(4 * p.numel, block) for p in stage_params(request.specs, shape.tp))
        states.append(fp32 + -(-2 * fp32 // shards))
        grads.append(fp32)
        trace = cached_trace(*request)
        kept.append(trace.kept_per_micro_batch - (0 if i == 0 else received))
        w = trace.later.get((ActionKind.W, True))
        awaiting.append(kept[-1] if w is None else -w.net)
        copies.append(trace.weight_copies)
        spans = [trace.begin, *trace.first.values(), *trace.later.values()]
        transient.append(max(span.peak - max(span.net, 0) for span in spans))
    return LayerSums(
        states=tuple(states),
        grads=tuple(grads),
        kept=tuple(kept),
        copies=tuple(copies),
        transient=tuple(transient),
        awaiting_w=tuple(awaiting),
    )


def layer_requests(
    specs: Sequence[LayerSpec], shape: StageShape, device: str, styles: tuple[bool, ...]
) -> list[TraceRequest]:
    """What `layer_sums` traces: each layer alone, as stage 0 when it is the first layer and
    as the last stage when it is the last."""
    last = len(specs) - 1
    return [
        TraceRequest((spec,), i == 0, i == last, styles, shape, device)
        for i, spec in enumerate(specs)
    ]


def held_with_gradients(actions: Sequence[Action]) -> int:
    """Most micro-batches holding a stash once the stage's first backward has begun (its
    gradients then exist): F opens a stash, B or W closes it, as `in_flight` counts."""
    live = peak = 0
    started = False
    for action in actions:
        if action.kind is ActionKind.F:
            live += 1
        elif action.kind in (ActionKind.B, ActionKind.I):
            started = True
        if action.kind in (ActionKind.B, ActionKind.W):
            live -= 1
        if started:
            peak = max(peak, live)
    return peak


def stage_bytes(
    sums: LayerSums, schedule: Schedule, *, dp: int = 1
) -> Callable[[int, int, int], int]:
    """`bytes(stage, first, stop)`: layers `[first, stop)` as stage `stage` of `schedule`.

    Gradients exist only from the stage's first backward, so a stage that runs every forward
    first is not charged them on top of every stash. With dp > 1 the step ends with the
    gradients flattened for the all-reduce bucket by bucket, each bucket's views replacing
    them as it is made (`BucketedAllReduce.start`): the gradients and one bucket.
    """
    rows = [stage_actions(schedule, s) for s in range(schedule.num_stages)]
    before = [in_flight(row) for row in rows]
    after = [held_with_gradients(row) for row in rows]
    ps, pg, pk, pc = (
        list(accumulate(v, initial=0)) for v in (sums.states, sums.grads, sums.kept, sums.copies)
    )

    peaks = _range_maxima(sums.transient)

    def held(stage: int, first: int, stop: int) -> int:
        grads, kept = pg[stop] - pg[first], pk[stop] - pk[first]
        fixed = ps[stop] - ps[first] + pc[stop] - pc[first]
        tail = grads + dp_bucket_copy(grads) if dp > 1 else 0
        during = max(before[stage] * kept, grads + after[stage] * kept) + peaks[first][stop]
        return fixed + max(during, tail)

    return held


def _range_maxima(values: Sequence[int]) -> list[list[int]]:
    """`maxima[a][b]`: the largest of `values[a:b]` (0 when empty), for every range."""
    maxima = []
    for first in range(len(values) + 1):
        row, best = [0] * (len(values) + 1), 0
        for stop in range(first + 1, len(values) + 1):
            best = max(best, values[stop - 1])
            row[stop] = best
        maxima.append(row)
    return maxima


def stage_needs(
    specs: Sequence[LayerSpec],
    schedule: Schedule,
    shape: StageShape,
    *,
    device: str,
    dp: int = 1,
    zero: int = 0,
) -> Callable[[int, int, int], int]:
    """`needs(stage, first, stop)`: bytes of layers `[first, stop)` as `stage`, by the
    per-layer sums, traced with the schedule's backward style."""
    if schedule.num_stages != schedule.num_ranks:
        raise ValueError(
            f"--partition memory with {schedule.num_stages // schedule.num_ranks} stages per rank: "
            "it budgets one stage per device; use --stages-per-rank 1 or another --partition"
        )
    styles = backward_styles(stage_actions(schedule, 0)) or (False,)
    sums = layer_sums(tuple(specs), shape, device, dp if zero else 1, styles)
    return stage_bytes(sums, schedule, dp=dp)


def fitting_partition(
    specs: Sequence[LayerSpec],
    needs: Callable[[int, int, int], int],
    num_stages: int,
    *,
    budget: int,
    shape: StageShape,
    extra: Sequence[int] | None = None,
) -> Partition:
    """The split with the smallest slowest stage (by FLOPs) whose every stage needs at most
    `budget` bytes, `extra[s]` added to stage s (what the sums missed on an earlier try); a
    clear error with the smallest budget any split fits when none does."""
    added = list(extra) if extra is not None else [0] * num_stages
    times = flop_costs(specs, batch_size=shape.micro_batch_size, seq_len=shape.seq_len)

    def held(stage: int, first: int, stop: int) -> int:
        return needs(stage, first, stop) + added[stage]

    def floor() -> str:
        need = _smallest_budget(times, num_stages, held)
        return (
            f"the smallest device that any split fits needs {need / 2**30:.1f} GiB, over the "
            f"{budget / 2**30:.1f} GiB given: add pipeline stages, recompute or shard, or "
            "give a larger --device-memory"
        )

    return fastest_fitting(
        times, num_stages, lambda s, a, b: held(s, a, b) <= budget, what_fails=floor
    )


def least_memory_partition(
    specs: Sequence[LayerSpec],
    needs: Callable[[int, int, int], int],
    num_stages: int,
    *,
    shape: StageShape,
    extra: Sequence[int],
) -> Partition:
    """The fastest split among those needing the smallest budget any split needs."""
    times = flop_costs(specs, batch_size=shape.micro_batch_size, seq_len=shape.seq_len)

    def held(stage: int, first: int, stop: int) -> int:
        return needs(stage, first, stop) + extra[stage]

    least = _smallest_budget(times, num_stages, held)
    return fastest_fitting(times, num_stages, lambda s, a, b: held(s, a, b) <= least)


def _smallest_budget(
    times: Sequence[float], num_stages: int, held: Callable[[int, int, int], int]
) -> int:
    """The least budget some split fits (bisection: fitting is monotone in the budget)."""
    low, high = 0, max(held(s, 0, len(times)) for s in range(num_stages))

    def within(limit: int) -> StageFits:
        return lambda stage, first, stop: held(stage, first, stop) <= limit

    while low < high:
        middle = (low + high) // 2
        fits = min_bottleneck(times, num_stages, within(middle)) is not None
        low, high = (low, middle) if fits else (middle + 1, high)
    return low
