"""The planner's memory screen: which candidate layouts fit the budget, with the least
recompute, and each one's per-stage and per-rank peaks (`engine.plan.budget`).

Candidates go in the order of a floor that needs no schedule (`floor`); once the floor is
over the budget and over the lowest peak seen, the rest are over too. A candidate whose
schedule at its fewest micro-batches is already over (`count_floor`) is never built at its
own length. Where a rank is over, its stages are recomputed (whole, then per layer), then
every stage. When nothing fits, the lowest peak of any candidate is what the user is told
to provide (`least_peak`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from engine.memory.trace_store import trace_ahead
from engine.plan.budget import rank_floor, rank_peaks
from engine.plan.candidates import Candidate, candidates, meshes
from engine.plan.context import SearchContext
from engine.plan.request import PlanRequest, Progress, reporting

__all__ = [
    "DOUBLINGS",
    "EVERY",
    "Fitted",
    "MemoryScreen",
    "all_candidates",
    "any_fits",
    "count_floor",
    "fewest_devices",
    "fit",
    "floor",
    "least_peak",
    "screen_memory",
]

EVERY = 1
"""The run length tried for `--recompute every:N`: one layer's activations regenerated at a
time, each layer's input kept (as Megatron's full per-layer recompute)."""


@dataclass(frozen=True, kw_only=True)
class Fitted:
    """A candidate with the recompute that fits it, its boundaries and its peaks."""

    candidate: Candidate
    boundaries: tuple[int, ...]
    stage_peaks: tuple[int, ...]
    rank_peaks: tuple[int, ...]


def fit(search: SearchContext, c: Candidate, budget: int) -> Fitted | int:
    """The candidate with the least recompute that fits; else the lowest peak it reaches.
    Tried in turn: none; where a rank is over the budget, its stages recomputed whole, then
    per layer (`EVERY`); every stage whole, then per layer. Split backwards too: recompute
    lowers their peaks as it does fused ones' (gpt-tiny's stage 0 under ZB-H1 at pp 2: 1.74
    → 1.21 MB, the replay and a tracked run equal to the byte)."""
    pipeline = search.pipeline(c)
    counts = pipeline.counts
    bounds = search.boundaries(pipeline.num_stages)
    sums = search.sums(c)

    def peaks(recomputed: Sequence[int], every: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        chosen = set(recomputed)
        return rank_peaks(
            sums,
            pipeline.placement,
            counts,
            bounds,
            micro_batch_size=c.micro_batch_size,
            recomputed=[s in chosen for s in range(pipeline.num_stages)],
            reduce_copy=c.mesh.dp > 1 and c.zero == 0,
            every=every,
        )

    every = tuple(range(pipeline.num_stages))
    tried: list[tuple[tuple[int, ...], int]] = [((), 0)]
    stages, ranks = peaks((), 0)
    if max(ranks) > budget:
        over = [r for r, peak in enumerate(ranks) if peak > budget]
        some = tuple(sorted(s for r in over for s in pipeline.stages_of(r)))
        wholes = [some, every] if some != every else [every]
        tried = [(stages, n) for stages in wholes for n in (0, EVERY)]
    lowest = max(ranks)
    for recompute, n in tried:
        stages, ranks = peaks(recompute, n)
        lowest = min(lowest, max(ranks))
        if max(ranks) <= budget:
            chosen = replace(c, recompute=recompute, recompute_every=n if recompute else 0)
            return Fitted(candidate=chosen, boundaries=bounds, stage_peaks=stages, rank_peaks=ranks)
    return lowest


def floor(state: SearchContext, c: Candidate) -> int:
    """A lower bound of the candidate's peak under any recompute, without its schedule: the
    highest stage's states and gradients (twice where the dp all-reduce copies them,
    `stage_floors`), and where those fit, with one micro-batch's activations
    (`SearchContext.peak_floor`). Sends are not counted: how many a stage holds depends on
    its schedule (`held_input_gradients`)."""
    twice = c.mesh.dp > 1 and c.zero == 0
    states = _states_floor(state, c)
    if states > state.request.device_memory:
        return states
    return max(
        states,
        state.peak_floor(
            state.layout(c),
            c.split,
            c.num_stages,
            c.micro_batch_size,
            reduce_copy=twice,
            several=c.micro_batches > 1,
            recompute_runs=(0, EVERY),
        ),
    )


def _states_floor(state: SearchContext, c: Candidate) -> int:
    """The highest stage's states and gradients: `floor` without a trace."""
    twice = c.mesh.dp > 1 and c.zero == 0
    first, later = state.stage_floors(state.layout(c), c.num_stages, twice)
    return first if later is None else max(first, later)


def _trace_ahead(
    state: SearchContext, candidates: Sequence[Candidate], progress: Progress | None
) -> None:
    """The layer traces the screen will read made at once (`trace_ahead`): those of every
    candidate whose states alone fit, whose `floor` traces its layers."""
    budget = state.request.device_memory
    read = {(state.layout(c), c.split) for c in candidates if _states_floor(state, c) <= budget}
    requests = (r for layout, split in read for r in state.layer_requests(layout, split))
    trace_ahead(requests, reporting(progress, "tracing layers"))


def all_candidates(state: SearchContext) -> list[Candidate]:
    """Every layout of the request: each mesh's schedules, micro-batchings and ZeRO levels."""
    request = state.request
    tied = any(spec.tie_key is not None for spec in state.specs)
    found: list[Candidate] = []
    for mesh in meshes(
        request.model,
        request.devices,
        num_layers=len(state.specs),
        seq_len=request.seq_len,
        gpus_per_node=request.hardware.gpus_per_node,
    ):
        found += candidates(
            mesh,
            global_batch=request.global_batch,
            num_layers=len(state.specs),
            micro_batch_sizes=request.micro_batch_sizes,
            schedules=request.schedules,
            tied=tied,
        )
    return found


def count_floor(state: SearchContext, c: Candidate) -> int | None:
    """A lower bound of the candidate's peak from its schedule at fewer micro-batches
    (`SearchContext.floor_pipeline`), under any recompute; None where there is no shorter one.
    Most layouts over the budget are over at their fewest micro-batches, so their long
    schedule is never built."""
    shorter = state.floor_pipeline(c)
    if shorter is None:
        return None
    return rank_floor(
        state.sums(c),
        shorter.placement,
        shorter.counts,
        state.boundaries(shorter.num_stages),
        micro_batch_size=c.micro_batch_size,
        reduce_copy=c.mesh.dp > 1 and c.zero == 0,
        recompute_runs=(0, EVERY),
    )


@dataclass(frozen=True, kw_only=True)
class MemoryScreen:
    fitted: list[Fitted]
    considered: int
    over: int
    least: float
    """The lowest peak of a candidate over the budget (inf when none was)."""
    deferred: list[tuple[int, Candidate]]
    """Over the budget by `count_floor` (with that bound), below `least`: their own lowest
    peaks are worked out only when no plan fits (`least_peak`)."""


def screen_memory(state: SearchContext, progress: Progress | None = None) -> MemoryScreen:
    """Every candidate in the order of its `floor`: those that fit, with their recompute and
    peaks, and how many are over the budget."""
    budget = state.request.device_memory
    candidates = all_candidates(state)
    _trace_ahead(state, candidates, progress)
    floored = sorted(((floor(state, c), c) for c in candidates), key=lambda x: x[0])
    state.count_ahead(
        (key for low, c in floored if low <= budget for key in state.count_keys(c)),
        reporting(progress, "counting schedules"),
    )
    fitted: list[Fitted] = []
    deferred: list[tuple[int, Candidate]] = []
    over, least = 0, math.inf
    for low, c in floored:
        if low > budget and low >= least:
            over += 1
            continue
        bound = count_floor(state, c)
        if bound is not None and bound > budget:
            over += 1
            if bound < least:
                deferred.append((bound, c))
            continue
        found = fit(state, c, budget)
        if isinstance(found, int):
            over, least = over + 1, min(least, found)
            continue
        fitted.append(found)
    if fitted:  # else `least_peak` reads the deferred ones' counts
        state.stop_counting()
    return MemoryScreen(
        fitted=fitted, considered=len(floored), over=over, least=least, deferred=deferred
    )


def any_fits(state: SearchContext) -> bool:
    """Whether some candidate fits the budget by the screen: `screen_memory`'s walk in the
    order of `floor`, stopped at the first that fits or the first whose floor is over."""
    budget = state.request.device_memory
    candidates = all_candidates(state)
    _trace_ahead(state, candidates, None)
    for low, c in sorted(((floor(state, c), c) for c in candidates), key=lambda x: x[0]):
        if low > budget:
            return False
        bound = count_floor(state, c)
        if (bound is None or bound <= budget) and not isinstance(fit(state, c, budget), int):
            return True
    return False


def least_peak(state: SearchContext, screen: MemoryScreen) -> float:
    """The lowest peak of any candidate the screen put over the budget: the deferred ones
    fitted now (no plan fits, so this is what the user is told to provide)."""
    least = screen.least
    for bound, c in sorted(screen.deferred, key=lambda x: x[0]):
        if bound >= least:
            break
        lowest = fit(state, c, state.request.device_memory)
        assert isinstance(lowest, int), "over the budget at fewer micro-batches, over at more"
        least = min(least, lowest)
    state.stop_counting()
    return least


DOUBLINGS = 6
"""How far `fewest_devices` looks: up to 2^6 = 64 times the devices asked for."""


def fewest_devices(request: PlanRequest, progress: Progress | None = None) -> int | None:
    """The fewest devices, doubling the request's up to `DOUBLINGS` times, on which some
    layout passes the memory screen (`any_fits`), the per-device memory and the batch
    unchanged; None when none does. What a user whose model fits no layout is told to ask
    for: the screen's count, which a search on that many devices then checks exactly."""
    for doubling in range(1, DOUBLINGS + 1):
        larger = replace(request, devices=request.devices * 2**doubling)
        if progress is not None:
            progress(f"none fits: screening {larger.devices} devices", doubling, DOUBLINGS)
        if any_fits(SearchContext(larger)):
            return larger.devices
    return None
