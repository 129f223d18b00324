"""The planner's search: every candidate layout screened for memory, the survivors timed.

Memory first (`engine.plan.screen`): the candidates that fit, each with the least recompute.
Then time: a lower bound per survivor (its busiest rank's compute and communication, no
bubble), and the simulator (`engine.plan.timing`) in the order of that bound until the bound
alone is slower than the best plans found, so a 64-device search simulates a few dozen of its
thousands of candidates. Each loser is charged to what cost it most against the best plan:
memory, bubble (idle time, imbalance included), communication or recompute.
"""

from __future__ import annotations

import contextlib
import gc
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace

from engine.memory.workers import kept_workers
from engine.plan.budget import rank_peaks
from engine.plan.candidates import Candidate
from engine.plan.context import SearchContext
from engine.plan.exact import replayed
from engine.plan.pricing import Priced, prediction, priced, simulated_step, with_timeline
from engine.plan.request import (
    LOSSES,
    PlanRequest,
    PlanResult,
    Prediction,
    Progress,
)
from engine.plan.screen import least_peak, screen_memory
from engine.plan.timing import StageTimes

__all__ = ["predict", "search", "step_with_costs"]


def _loss(plan: Prediction, best: Prediction) -> str:
    """What cost `plan` most against `best`: communication, recompute, or else idle time."""
    comm = plan.communication - best.communication
    recompute = plan.recompute - best.recompute
    rest = plan.step_time - best.step_time - comm - recompute
    reasons = {"more bubble": rest, "more communication": comm, "more recompute": recompute}
    return max(reasons, key=lambda k: reasons[k])


def search(
    request: PlanRequest, progress: Progress | None = None, *, timeline: bool = False
) -> PlanResult:
    """The best `request.top` layouts, and why every other candidate lost; with `timeline`,
    the best one's simulated timeline too (`Prediction.simulated`, what `plot_plan` draws:
    a second, slower simulation, a second of a 405b search)."""
    with _no_cycle_collection(), kept_workers():
        return _search(request, progress, timeline)


@contextlib.contextmanager
def _no_cycle_collection() -> Iterator[None]:
    """Python's cycle collector paused for the search: the search keeps millions of small
    acyclic objects (its schedules' actions), and each full collection walked them all, a
    sixth of a 405b search. Reference counting still frees them."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _search(request: PlanRequest, progress: Progress | None, timeline: bool) -> PlanResult:
    state = SearchContext(request)
    screen = screen_memory(state, progress)
    survivors = [
        replace(
            priced(state, f.candidate, f.boundaries),
            stage_peaks=f.stage_peaks,
            rank_peaks=f.rank_peaks,
        )
        for f in screen.fitted
    ]
    ranked = _rank(state, survivors, progress, timeline)
    losses = dict.fromkeys(LOSSES, 0)
    losses["over memory"] = screen.over + len(ranked.over)
    decided = {id(p.candidate) for p in (*ranked.best, *ranked.over)}
    for plan in ranked.plans:
        if id(plan.candidate) not in decided:
            losses[_loss(plan, ranked.best[0] if ranked.best else plan)] += 1
    least = math.inf if ranked.best else least_peak(state, screen)
    least = min([least, *(max(p.rank_peaks) for p in ranked.over)])
    return PlanResult(
        request=request,
        plans=ranked.best,
        considered=screen.considered,
        losses=losses,
        least_memory=None if ranked.best or least == math.inf else int(least),
    )


def predict(request: PlanRequest, candidate: Candidate) -> Prediction:
    """One given layout's prediction (balanced boundaries, its own recompute), memory by the
    fast screen: what the search computes for each candidate, for comparing a hand choice."""
    _check_batch(request, candidate)
    state = SearchContext(request)
    pipeline = state.pipeline(candidate)
    bounds = state.boundaries(pipeline.num_stages)
    stage_peaks, peaks = rank_peaks(
        state.sums(candidate),
        pipeline.placement,
        pipeline.counts,
        bounds,
        micro_batch_size=candidate.micro_batch_size,
        recomputed=[s in candidate.recompute for s in range(pipeline.num_stages)],
        reduce_copy=candidate.mesh.dp > 1 and candidate.zero == 0,
        every=candidate.recompute_every,
    )
    screened = replace(priced(state, candidate, bounds), stage_peaks=stage_peaks, rank_peaks=peaks)
    return with_timeline(
        state, screened, prediction(state, screened, simulated_step(state, screened))
    )


def step_with_costs(
    request: PlanRequest,
    plan: Prediction,
    stages: Sequence[StageTimes],
    after: Sequence[float],
) -> float:
    """The plan's step simulated as the search simulates it, but with the action costs given
    (each stage's) and each pipeline rank's work after its last backward (`after`: its
    reductions and optimizer update): a run's own, read from its trace, to tell the
    simulator's structure apart from the prices the search gave it. A run whose ranks shared
    its host's cores (`Hardware.host_cores`) ran its actions so, their times with it: each
    rank is simulated on a core of its own."""
    own = replace(request, hardware=replace(request.hardware, host_cores=0))
    state = SearchContext(own)
    screened = priced(state, plan.candidate, plan.boundaries)
    given = replace(screened, stages=tuple(stages), tails=tuple(after), updates=(0.0,) * len(after))
    return simulated_step(state, given).step


def _check_batch(request: PlanRequest, c: Candidate) -> None:
    """The search makes only layouts that split the global batch; a hand choice may not,
    and its memory and time would then be those of another batch."""
    per_step = c.micro_batches * c.micro_batch_size * c.mesh.dp
    if per_step != request.global_batch:
        raise ValueError(
            f"{c.describe()} trains {c.micro_batches} × {c.micro_batch_size} × dp {c.mesh.dp} = "
            f"{per_step} sequences a step, not the global batch of {request.global_batch}: "
            f"use {request.global_batch // (c.micro_batch_size * c.mesh.dp)} micro-batches "
            "or another micro-batch size"
        )


_REPLAYS = 12
"""Most exact replays one search runs before it gives up on the fast screen's choices."""


def _key(c: Candidate) -> tuple[object, ...]:
    """Plans of one key differ only in ZeRO level or recompute: variants, not other plans."""
    return (c.mesh, c.schedule, c.stages_per_rank, c.micro_batch_size)


@dataclass(frozen=True, kw_only=True)
class _Ranked:
    plans: list[Prediction]
    """Every survivor of the screen, simulated or at its lower bound."""
    best: tuple[Prediction, ...]
    """The fastest of distinct keys the replay fits, fastest first, with its peaks."""
    over: list[Prediction]
    """Those the replay put over the budget."""


def _rank(
    state: SearchContext, screened: list[Priced], progress: Progress | None, timeline: bool
) -> _Ranked:
    """Survivors simulated in the order of their lower bound while it could still enter the
    best `top`; then the best of distinct keys not replayed yet replayed exactly, together
    (`exact.replayed`), each the replay puts over the budget dropped for the next (which may
    call for more simulations); the rest at their bound."""
    request = state.request
    order = sorted(screened, key=lambda s: s.bound)
    state.programs.ahead(k for s in order for k in state.sample_keys(state.pipeline(s.candidate)))
    simulated: list[Prediction] = []
    exact: dict[int, Prediction] = {}
    over: list[Prediction] = []
    dropped: set[int] = set()
    done = 0
    while True:
        while done < len(order) and order[done].bound < _kth(simulated, dropped, request.top):
            simulated.append(prediction(state, order[done], simulated_step(state, order[done])))
            done += 1
            if progress is not None:
                progress("timing layouts", done, len(order))
        state.programs.stop()  # the workers replay next
        chosen = _distinct_best(simulated, dropped, request.top)
        pending = [p for p in chosen if id(p.candidate) not in exact]
        if not pending or len(exact) + len(over) >= _REPLAYS:
            break
        room = _REPLAYS - len(exact) - len(over)
        for plan in replayed(request, pending[:room], progress):
            if max(plan.rank_peaks) > request.device_memory:
                over.append(plan)
                dropped.add(id(plan.candidate))
            else:
                exact[id(plan.candidate)] = plan
    if progress is not None:
        progress("timing layouts", len(order), len(order))
    by_id = {id(s.candidate): s for s in order}
    best = tuple(exact[id(p.candidate)] for p in chosen if id(p.candidate) in exact)
    if timeline and best:
        best = (with_timeline(state, by_id[id(best[0].candidate)], best[0]), *best[1:])
    rest = [prediction(state, s, None) for s in order[done:]]
    return _Ranked(plans=simulated + rest, best=best, over=over)


def _distinct_best(plans: Sequence[Prediction], dropped: set[int], top: int) -> list[Prediction]:
    """The fastest plan of each of the `top` fastest keys, leaving out those `dropped`."""
    best: dict[tuple[object, ...], Prediction] = {}
    for plan in sorted(plans, key=lambda p: p.step_time):
        if id(plan.candidate) not in dropped:
            best.setdefault(_key(plan.candidate), plan)
    return list(best.values())[:top]


def _kth(plans: Sequence[Prediction], dropped: set[int], top: int) -> float:
    """The step a candidate must beat to enter the best `top` (inf while fewer are known)."""
    chosen = _distinct_best(plans, dropped, top)
    return chosen[-1].step_time if len(chosen) == top else math.inf
