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
from bisect import bisect_right
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace

from engine.memory.workers import kept_workers
from engine.plan.budget import rank_peaks
from engine.plan.candidates import Candidate
from engine.plan.context import Pipeline, SearchContext
from engine.plan.exact import replayed
from engine.plan.hardware import all_gather_time, all_reduce_time, reduce_scatter_time
from engine.plan.request import (
    LOSSES,
    PlanRequest,
    PlanResult,
    Prediction,
    Progress,
)
from engine.plan.screen import least_peak, screen_memory
from engine.plan.timing import StageTimes, Timed, dp_tail, stage_times, with_tails

__all__ = ["predict", "search", "step_with_costs"]


@dataclass(frozen=True, kw_only=True)
class _Screened:
    candidate: Candidate
    boundaries: tuple[int, ...]
    stages: tuple[StageTimes, ...]
    p2p: float
    tails: tuple[float, ...]
    """Per rank, its communication after its last backward: the sum of tied weights'
    gradients across the pipeline and the data-parallel reduction."""
    updates: tuple[float, ...]
    """Per rank, its optimizer update (of its shard under ZeRO), after the tail."""
    bound: float
    stage_peaks: tuple[int, ...]
    rank_peaks: tuple[int, ...]


def _stage_costs(
    search: SearchContext, c: Candidate, layers: Sequence[range], params: Sequence[float]
) -> list[StageTimes]:
    """Each stage's action costs: compute, tp all-reduces, ZeRO-3's per-micro-batch turns."""
    r, hw, mesh = search.request, search.request.hardware, c.mesh
    forward = search.forward(c.micro_batch_size, mesh.tp)
    hidden_bytes = c.micro_batch_size * r.seq_len * search.hidden * search.size
    dp_bw = hw.bandwidth((mesh.dp - 1) * mesh.tp + 1)
    stages = []
    for s, stage in enumerate(layers):
        turn = (0.0, 0.0)
        if c.zero == 3 and c.zero_reshard == "micro-batch":
            gather = all_gather_time(search.size * params[s], mesh.dp, dp_bw, hw.latency)
            scatter = reduce_scatter_time(4 * params[s], mesh.dp, dp_bw, hw.latency)
            turn = (gather, gather + scatter)
        stages.append(
            stage_times(
                forward,
                search.specs,
                stage,
                hardware=hw,
                activation_bytes=hidden_bytes,
                tp=mesh.tp,
                recompute=s in c.recompute,
                input_shares=search.input_shares(c.micro_batch_size),
                zero_turn=turn,
            )
        )
    return stages


def _tie_sums(
    search: SearchContext, c: Candidate, pipeline: Pipeline, bounds: Sequence[int]
) -> list[float]:
    """Per rank, its share of summing tied weights' fp32 gradients over the ranks holding a
    copy (GPT-2's embedding on the first stage, its head on the last), before the optimizer:
    an all-reduce across the pipeline, nothing where one rank holds every copy (V placement,
    pp 1)."""
    hw, mesh = search.request.hardware, c.mesh
    sums = [0.0] * mesh.pp
    for layers, numel in search.ties.values():
        ranks = {pipeline.rank_of(bisect_right(bounds, i) - 1) for i in layers}
        if len(ranks) < 2:
            continue
        width = (mesh.pp - 1) * mesh.dp * mesh.tp + 1
        seconds = all_reduce_time(4 * numel / mesh.tp, len(ranks), hw.bandwidth(width), hw.latency)
        for rank in ranks:
            sums[rank] += seconds
    return sums


def _screen(search: SearchContext, c: Candidate, bounds: Sequence[int]) -> _Screened:
    """Action costs, transfers, data-parallel tails and the step's lower bound."""
    r, hw, mesh = search.request, search.request.hardware, c.mesh
    pipeline = search.pipeline(c)
    hidden_bytes = c.micro_batch_size * r.seq_len * search.hidden * search.size
    layers = [range(bounds[s], bounds[s + 1]) for s in range(pipeline.num_stages)]
    params = [sum(search.params[i] for i in stage) / mesh.tp for stage in layers]
    width = (mesh.dp - 1) * mesh.tp + 1
    stages = _stage_costs(search, c, layers, params)
    ties = _tie_sums(search, c, pipeline, bounds)
    held = [sum(params[s] for s in pipeline.stages_of(rank)) for rank in range(mesh.pp)]
    tails = tuple(
        dp_tail(
            held[rank],
            size=search.size,
            dp=mesh.dp,
            zero=c.zero,
            reshard=c.zero_reshard,
            hardware=hw,
            width=width,
        )
        + ties[rank]
        for rank in range(mesh.pp)
    )
    shards = mesh.dp if c.zero else 1
    updates = tuple(hw.update_time(rank_params / shards) for rank_params in held)
    p2p = 0.0
    if mesh.pp > 1:
        p2p = hidden_bytes / mesh.tp / hw.bandwidth(mesh.dp * mesh.tp + 1) + hw.latency
    # the last rank waits for the first micro-batch to pass every rank before it
    fill = (mesh.pp - 1) * (min(s.forward for s in stages) + p2p)
    bound = max(
        c.micro_batches * sum(stages[s].forward + stages[s].backward for s in pipeline.stages_of(k))
        + tails[k]
        + updates[k]
        + (fill if k == mesh.pp - 1 else 0.0)
        for k in range(mesh.pp)
    )
    return _Screened(
        candidate=c,
        boundaries=tuple(bounds),
        stages=tuple(stages),
        p2p=p2p,
        tails=tails,
        updates=updates,
        bound=bound,
        stage_peaks=(),
        rank_peaks=(),
    )


def _costs(search: SearchContext, s: _Screened) -> tuple[float, float]:
    """(communication, recompute) seconds of the busiest rank's step."""
    c = s.candidate
    pipeline = search.pipeline(c)
    comm, recompute = 0.0, 0.0
    for rank in range(c.mesh.pp):
        mine = pipeline.stages_of(rank)
        transfers = 2 * (c.mesh.pp - 1) * c.stages_per_rank * s.p2p
        turns = sum(s.stages[k].tp_comm for k in mine) * c.micro_batches
        comm = max(comm, s.tails[rank] + turns + transfers)
        recompute = max(recompute, c.micro_batches * sum(s.stages[k].recompute for k in mine))
    return comm, recompute


def _predict(search: SearchContext, s: _Screened, timed: Timed | None) -> Prediction:
    """The screened candidate's prediction, timed by the simulator or else at its bound; its
    timeline is drawn for the plans shown only (`_with_timeline`)."""
    r = search.request
    step = timed.step if timed is not None else s.bound
    comm, recompute = _costs(search, s)
    model_flops = 3 * sum(search.flops) * r.global_batch
    return Prediction(
        candidate=s.candidate,
        boundaries=s.boundaries,
        step_time=step,
        bubble=timed.bubble if timed is not None else 0.0,
        tokens_per_s=r.global_batch * r.seq_len / step,
        mfu=model_flops / (step * r.devices * r.hardware.device_flops),
        communication=comm,
        recompute=recompute,
        stage_peaks=s.stage_peaks,
        rank_peaks=s.rank_peaks,
    )


def _with_timeline(search: SearchContext, s: _Screened, plan: Prediction) -> Prediction:
    """The plan with its simulated timeline: the step's, or its longer sample's."""
    sample = search.samples(search.pipeline(s.candidate))[-1]
    tails = tuple(tail + update for tail, update in zip(s.tails, s.updates, strict=True))
    return replace(plan, simulated=search.timeline(sample, s.stages, s.p2p), tails=tails)


def _simulate(search: SearchContext, s: _Screened) -> Timed:
    """The step simulated, or extended from its two samples (`Pipeline.lengths`)."""
    pipeline = search.pipeline(s.candidate)
    after = tuple(tail + update for tail, update in zip(s.tails, s.updates, strict=True))
    samples = search.sample_keys(pipeline)
    timed = [with_tails(search.run(x, s.stages, s.p2p), after) for x in samples]
    if len(timed) == 1:
        return timed[0]
    (low, high), (shorter, longer) = timed, pipeline.lengths
    pp, m = pipeline.num_ranks, pipeline.micro_batches
    per_micro_batch = (high.step - low.step) / (longer - shorter)
    step = low.step + per_micro_batch * (m - shorter)
    busy = high.busy * m / longer
    return Timed(step=step, bubble=1 - busy / (pp * step), busy=busy)


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
            _screen(state, f.candidate, f.boundaries),
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
    screened = replace(_screen(state, candidate, bounds), stage_peaks=stage_peaks, rank_peaks=peaks)
    return _with_timeline(state, screened, _predict(state, screened, _simulate(state, screened)))


def step_with_costs(
    request: PlanRequest,
    plan: Prediction,
    stages: Sequence[StageTimes],
    after: Sequence[float],
) -> float:
    """The plan's step simulated as the search simulates it, but with the action costs given
    (each stage's) and each pipeline rank's work after its last backward (`after`: its
    reductions and optimizer update): a run's own, read from its trace, to tell the
    simulator's structure apart from the prices the search gave it."""
    state = SearchContext(request)
    screened = _screen(state, plan.candidate, plan.boundaries)
    given = replace(screened, stages=tuple(stages), tails=tuple(after), updates=(0.0,) * len(after))
    return _simulate(state, given).step


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
    state: SearchContext, screened: list[_Screened], progress: Progress | None, timeline: bool
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
            simulated.append(_predict(state, order[done], _simulate(state, order[done])))
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
        best = (_with_timeline(state, by_id[id(best[0].candidate)], best[0]), *best[1:])
    rest = [_predict(state, s, None) for s in order[done:]]
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
