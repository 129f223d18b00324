"""A stage's step traced once on fake tensors, and a rank's row composed from the traces.

`trace_stage` replays (`replay.StageRun`) the step start and two micro-batches of a stage's
backward style (and one of a second style after them), split over tp with the engine's DTensor
plans and, under ZeRO-3, sharded by the engine's FSDP2 protocol, on a fake world of dp × tp
ranks (`fake_world.stage_grid`), under the `MemoryTracker`. Micro-batches allocate alike, so
`compose` puts any schedule row together from the first and a later run of each action. Which
stages are traced, kept, derived from one another or traced ahead in workers is
`engine.memory.trace_store`'s.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch.distributed as dist
from torch._subclasses.fake_tensor import unset_fake_temporarily

from engine.config import require
from engine.memory.fake_world import StageGrid, stage_grid
from engine.memory.rank_states import fsdp_resizes, gathered_bytes
from engine.memory.replay import StageRun, StageShape, build_stage, fake_parameters
from engine.memory.tracker import MemoryTracker, Span, fake_device
from engine.parallel import FullyShardedLayers
from engine.runtime.sharded_stages import fully_shard_stages
from engine.schedule.actions import Action, ActionKind, split_units
from models import LayerSpec

__all__ = ["Phase", "StageTrace", "compose", "trace_stage"]

_NOTHING = Span(peak=0, net=0)

Phase = tuple[ActionKind, bool]
"""An action kind and whether its micro-batch's backward is split (I + W) or fused (B): a
forward recording for a W keeps different tensors than one before a fused B."""


@dataclass(frozen=True, kw_only=True)
class StageTrace:
    """One stage's traced step start and the first and a later run of each of its actions.

    A stage's first B (or W) allocates its gradients and later ones accumulate into them; its
    first F casts the weights, which every later F of the step reuses (`WeightCopies`); every
    other action allocates the same each time.
    """

    begin: Span
    """The step's token batch (first stage) and targets (last stage) arriving."""
    first: Mapping[Phase, Span]
    later: Mapping[Phase, Span]
    held_per_micro_batch: int
    """Sent tensors and losses one micro-batch leaves alive once its actions ran."""
    sent_back: int
    """Of those, its input gradients sent back: freed when the schedule proves them delivered
    (`engine.schedule.delivery`), the rest at the step's end."""
    weight_copies: int
    """Of the first forward's net bytes: the low-precision weight copies autocast made (or,
    under ZeRO-3, the layers FSDP gathered), kept until the step's end and shared by every
    micro-batch."""
    reduce: Span = _NOTHING
    """ZeRO-3 gathered for the step: after the stage's last backward, FSDP's reduce-scatter of
    every layer's gradient into its shard, and the reshard (none per micro-batch: each
    backward reduces its own)."""
    sends_copied: bool = False
    """A tensor the stage sent was not contiguous and was sent as a copy
    (`replay.StageRun.sends_copied`)."""

    @property
    def first_gradients(self) -> int:
        """Bytes the step's first backwards allocate and later ones do not: the gradients."""
        return sum(
            span.net - self.later[phase].net
            for phase, span in self.first.items()
            if phase[0] is not ActionKind.F
        )

    @property
    def kept_per_micro_batch(self) -> int:
        """Bytes a forward keeps until its backward, the weight copies aside (where fused and
        split micro-batches mix, a split one keeps its Linears' outputs too; the replay counts
        both)."""
        return next(span.net for (kind, _), span in self.later.items() if kind is ActionKind.F)


SECOND_STYLE_RUNS = 1
"""Micro-batches traced of a stage's second backward style (DualPipeV's stages mix two). The
first style's two micro-batches made every allocation a step makes once (the gradients,
whichever style's backward allocated them; the weight copies or FSDP's gathers), so the second
style's first micro-batch already allocates as its later ones do. A second run of it measured
the same trace (`tests/unit/test_first_style.py` traces both) and cost a quarter of a
two-style trace."""


def _group(style: bool | None) -> tuple[ActionKind, ...]:
    """What one micro-batch of a backward style runs: F B, F I W, or F alone."""
    if style is None:
        return (ActionKind.F,)
    return (ActionKind.F, ActionKind.I, ActionKind.W) if style else (ActionKind.F, ActionKind.B)


def trace_stage(
    specs: Sequence[LayerSpec],
    *,
    first: bool,
    last: bool,
    styles: tuple[bool, ...],
    shape: StageShape,
    cuda: bool,
    block: int,
    local: tuple[bool, bool] = (False, False),
) -> StageTrace:
    """Trace the step start, two micro-batches of the first backward style and one of a second
    (`SECOND_STYLE_RUNS`), in the stage's order, and under ZeRO-3 the step's gradient
    reduction.

    The order matters where styles mix: the first backward of the step allocates the gradients
    (a B all of them, an I only the non-GEMM ones) and later ones accumulate, and the first
    forward casts (or gathers) the weights, so it must be of the first style:
    `memory.stage_trace` checks.
    """
    order: tuple[bool | None, ...] = styles or (None,)
    split = frozenset(2 * i + j for i, style in enumerate(order) if style for j in (0, 1))
    with _stage_world(shape) as grid, fake_device(cuda=cuda):
        module = build_stage(specs)
        fake_parameters(module)
        run = StageRun(
            module,
            specs,
            first=first,
            last=last,
            split=split,
            shape=shape,
            local_in=local[0],
            local_out=local[1],
            tp_mesh=grid.tp_mesh,
        )
        fsdp = _fully_shard(run, shape, grid)
        tracker = MemoryTracker(block=block)
        with tracker, fsdp_resizes(tracker), run.stage.step_scope():
            begin = tracker.measure(functools.partial(_begin, run, fsdp))
            spans, weight_copies, held, sent_back = _trace_micro_batches(run, order, tracker, fsdp)
            reduce = tracker.measure(fsdp.reduce_gradients) if fsdp else _NOTHING
    return StageTrace(
        begin=begin,
        first=spans[0],
        later=spans[1],
        held_per_micro_batch=held,
        sent_back=sent_back,
        weight_copies=weight_copies,
        reduce=reduce,
        sends_copied=run.sends_copied,
    )


def _trace_micro_batches(
    run: StageRun,
    order: tuple[bool | None, ...],
    tracker: MemoryTracker,
    fsdp: FullyShardedLayers | None,
) -> tuple[list[dict[Phase, Span]], int, int, int]:
    """Spans of each style's first micro-batch and a later one's, the step-long copies the
    first forward made, what one micro-batch leaves held and of that what it sent back. The
    second style's first micro-batch runs once (`SECOND_STYLE_RUNS`) and stands for its later
    ones too."""
    spans: list[dict[Phase, Span]] = [{}, {}]
    weight_copies = held = sent_back = 0
    for i, style in enumerate(order):
        for j in range(SECOND_STYLE_RUNS if i else 2):
            for kind in _group(style):
                copies = tracker.weight_copies + gathered_bytes(fsdp)
                spans[j][(kind, bool(style))] = tracker.measure(
                    functools.partial(run.act, Action(0, kind, 2 * i + j))
                )
                if i == j == 0 and kind is ActionKind.F:
                    weight_copies = tracker.weight_copies + gathered_bytes(fsdp) - copies
            if i == j == 0:
                held = run.held_bytes(tracker.block)
                sent_back = run.sent_bytes(0, tracker.block)
    for phase, span in spans[0].items():
        spans[1].setdefault(phase, span)  # the second style's, in the order traced
    return spans, weight_copies, held, sent_back


def _begin(run: StageRun, fsdp: FullyShardedLayers | None) -> None:
    run.begin()
    if fsdp is not None:
        fsdp.begin_step()


def _fully_shard(run: StageRun, shape: StageShape, grid: StageGrid) -> FullyShardedLayers | None:
    """ZeRO-3: the stage's layers sharded by the engine's FSDP2 protocol over the grid's
    replicas, gathered in the compute dtype with no autocast weight copies, as the engine runs
    them (so the activations, norms and gradients have FSDP's dtypes)."""
    if not shape.fsdp_replicas:
        return None
    with unset_fake_temporarily():  # FSDP slices the mesh's real rank tensor
        return fully_shard_stages(
            [run.stage], grid.dp_mesh, shape.precision, pp_rank=0, reshard=[shape.fsdp_reshard]
        )


@contextlib.contextmanager
def _stage_world(shape: StageShape) -> Iterator[StageGrid]:
    """The grid a traced stage is split over: the engine's own DTensor plans (tp) and FSDP2
    (ZeRO-3's replicas) on a fake world (`stage_grid`), so the trace sees what they allocate
    (collectives' buffers, the vocabulary-parallel loss, the embedding's replicated gradient,
    FSDP's gathers and reduce-scatters) and not a stand-in with the shards' shapes."""
    dp, fsdp = max(shape.fsdp_replicas, 1), shape.fsdp_replicas > 0
    require(
        (dp * shape.tp == 1 and not fsdp) or not dist.is_initialized(),
        f"tracing a stage split over dp={dp} × tp={shape.tp} joins a fake world of "
        f"{dp * shape.tp} ranks, which a process already in a process group cannot: estimate "
        "before init_process_group (meshpipe partitions by memory before its ranks meet)",
    )
    with stage_grid(dp, shape.tp, fsdp=fsdp) as grid:
        yield grid


def compose(
    stages: Sequence[int],
    actions: Sequence[Action],
    traces: Mapping[int, StageTrace],
    *,
    gradients_first: bool = False,
    releases: Mapping[Action, tuple[Action, ...]] | None = None,
) -> tuple[int, int]:
    """Peak and final live bytes of a replay of `actions` (`replay.rank_events`), from each
    event's traced peak and net change.

    Micro-batches allocate alike, so this equals replaying all of them (tested).
    `gradients_first`: the step's gradient buffers exist from its start (ZeRO-1/2's flat
    fp32 buffers) rather than growing through the first backward: they count at the start
    and every backward is a later one (accumulating). `releases`: the input gradients sent
    back that each receive among `actions` frees (`replay.sends_released`).
    """
    events = [traces[s].begin for s in stages]
    if gradients_first:
        events += [Span(peak=g, net=g) for g in (traces[s].first_gradients for s in stages)]
    split = split_units(actions)
    seen: set[tuple[int, Phase]] = set()
    for action in actions:
        if not action.is_compute:
            freed = sum(traces[sent.stage].sent_back for sent in (releases or {})[action])
            events.append(Span(peak=0, net=-freed))
            continue
        phase = (action.kind, (action.stage, action.micro_batch) in split)
        key = (action.stage, phase)
        later = key in seen or (gradients_first and action.kind is not ActionKind.F)
        events.append((traces[action.stage].later if later else traces[action.stage].first)[phase])
        seen.add(key)
    live = peak = 0
    for span in events:
        peak = max(peak, live + span.peak)
        live += span.net
    return peak, live
