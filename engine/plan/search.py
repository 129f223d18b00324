"""The planner's search: every candidate layout screened for memory, the survivors timed.

Memory first: each candidate's per-rank peak (`engine.plan.budget`) without recompute, and
where a rank is over the budget, with the forward recomputed on that rank's stages only (then
on every stage). Then time: a lower bound per survivor (its busiest rank's compute and
communication, no bubble), and the simulator (`engine.plan.timing`) in the order of that bound
until the bound alone is slower than the best plans found, so a 64-device search simulates a
few dozen of its thousands of candidates. Each loser is charged to what cost it most against
the best plan: memory, bubble (idle time, imbalance included), communication or recompute.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from engine.config import PRECISIONS, require
from engine.memory.estimate import DEVICE_MODELS, MemoryConfig, estimate_memory
from engine.memory.states import StateLayout
from engine.memory.tracker import CUDA_BLOCK
from engine.plan.budget import LayerBytes, StageCounts, layer_bytes, rank_peaks, stage_counts
from engine.plan.candidates import Candidate, Mesh, candidates, meshes
from engine.plan.hardware import Hardware, all_gather_time, reduce_scatter_time
from engine.plan.timing import (
    StageTimes,
    Timed,
    dp_tail,
    layer_flops,
    simulate_stages,
    stage_times,
    with_tails,
)
from engine.schedule import SCHEDULES, Schedule, SimResult, add_communication, make_schedule
from models import get_config, layer_specs
from partitioners import Partition, partition_model

__all__ = [
    "LOSSES",
    "PlanRequest",
    "PlanResult",
    "Prediction",
    "layout_fields",
    "predict",
    "search",
]

LOSSES = ("over memory", "more bubble", "more communication", "more recompute")
"""Why a candidate lost to the best plan."""


@dataclass(frozen=True, kw_only=True)
class PlanRequest:
    """What to plan for: a model, devices and their memory, the batch, and the machine."""

    model: str
    devices: int
    device_memory: int
    """Bytes per device."""
    global_batch: int
    seq_len: int
    precision: str = "bf16"
    device: str = "cuda"
    """The memory model's device: cuda (allocator blocks) or cpu (exact bytes)."""
    hardware: Hardware = field(default_factory=Hardware)
    measured: Mapping[int, tuple[float, ...]] | None = None
    """Per micro-batch size, each layer's measured forward seconds (`--profile`); FLOPs at
    the hardware's rate when None."""
    micro_batch_sizes: tuple[int, ...] = (1, 2, 4, 8)
    schedules: tuple[str, ...] = tuple(SCHEDULES)
    top: int = 3

    def __post_init__(self) -> None:
        for name in ("devices", "global_batch", "seq_len", "device_memory", "top"):
            value = getattr(self, name)
            require(value >= 1, f"{name}={value} must be at least 1")
        context = get_config(self.model).max_seq_len
        require(
            self.seq_len <= context,
            f"--seq-len {self.seq_len} is longer than {self.model}'s context of {context} "
            f"tokens: use --seq-len {context} or less",
        )
        require(self.precision in PRECISIONS, f"precision {self.precision!r}: use {PRECISIONS}")
        require(self.device in DEVICE_MODELS, f"device {self.device!r}: use {DEVICE_MODELS}")
        unknown = sorted(set(self.schedules) - set(SCHEDULES))
        require(not unknown, f"unknown schedules {unknown}: choose among {', '.join(SCHEDULES)}")
        missing = [b for b in self.micro_batch_sizes if self.measured and b not in self.measured]
        require(not missing, f"micro-batch sizes {missing} have no measured layer times")


@dataclass(frozen=True, kw_only=True)
class Prediction:
    """A planned layout and what the memory model and the simulator predict for it."""

    candidate: Candidate
    boundaries: tuple[int, ...]
    step_time: float
    """Seconds per optimizer step."""
    bubble: float
    tokens_per_s: float
    mfu: float
    """Model FLOPs (3 × forward, recompute not counted) over the devices' peak."""
    communication: float
    """Seconds of the step the busiest rank spends in collectives and transfers."""
    recompute: float
    stage_peaks: tuple[int, ...]
    rank_peaks: tuple[int, ...]
    simulated: SimResult | None = None


@dataclass(frozen=True, kw_only=True)
class PlanResult:
    request: PlanRequest
    plans: tuple[Prediction, ...]
    """The best few, fastest first."""
    considered: int
    losses: dict[str, int]
    least_memory: int | None
    """The lowest per-device peak of any candidate (every stage recomputed)."""


def layout_fields(request: PlanRequest, c: Candidate, boundaries: Sequence[int]) -> dict[str, Any]:
    """A layout's settings by flat name (`engine.config`), every one of them."""
    every = len(c.recompute) == c.num_stages
    return {
        "model": request.model,
        "pp": c.mesh.pp,
        "dp": c.mesh.dp,
        "tp": c.mesh.tp,
        "schedule": c.schedule,
        "stages_per_rank": c.stages_per_rank,
        "micro_batches": c.micro_batches,
        "global_batch": request.global_batch,
        "seq_len": request.seq_len,
        "precision": request.precision,
        "partition": "boundaries:" + ",".join(map(str, boundaries)),
        "zero": c.zero,
        "zero_reshard": c.zero_reshard,
        "optimizer_impl": "per_tensor" if c.zero == 3 else "fused",
        "recompute": "full" if c.recompute else "none",
        "recompute_stages": None if every or not c.recompute else ",".join(map(str, c.recompute)),
    }


@dataclass(frozen=True, kw_only=True)
class _Screened:
    candidate: Candidate
    boundaries: tuple[int, ...]
    stages: tuple[StageTimes, ...]
    p2p: float
    tails: tuple[float, ...]
    bound: float
    stage_peaks: tuple[int, ...]
    rank_peaks: tuple[int, ...]


_SAMPLED = (3, 4)
"""Beyond 4 micro-batches per pipeline rank, a schedule is built and simulated with 3 and 4
per rank and extended linearly: past its warm-up a schedule repeats one pattern per
micro-batch, so its step time, busy time and in-flight counts grow (or stay) linearly."""


def _extend(low: Sequence[int], high: Sequence[int], m: int, pp: int) -> tuple[int, ...]:
    """Counts at `m` micro-batches from those at 3·pp and 4·pp."""
    k = _SAMPLED[0] * pp
    return tuple(a + (b - a) * (m - k) // pp for a, b in zip(low, high, strict=True))


@dataclass(frozen=True, kw_only=True)
class _Pipeline:
    """A schedule as the search uses it: itself, or two samples to extend from."""

    micro_batches: int
    samples: tuple[Schedule, ...]
    counts: StageCounts

    @property
    def shape(self) -> Schedule:
        """A schedule with the placement of the real one (ranks, stages)."""
        return self.samples[0]


class _Search:
    """Caches shared by every candidate of one request."""

    def __init__(self, request: PlanRequest) -> None:
        self.request = request
        self.specs = tuple(layer_specs(request.model))
        self.hidden = int(get_config(request.model).d_model)
        self.size = 4 if request.precision == "fp32" else 2
        self.params = tuple(spec.num_parameters() for spec in self.specs)
        self.flops = tuple(layer_flops(spec, request.seq_len) for spec in self.specs)

    @functools.cache  # noqa: B019 (one search, then dropped)
    def schedule(self, name: str, pp: int, m: int, v: int) -> _Pipeline:
        if m <= _SAMPLED[1] * pp:
            schedule = make_schedule(name, num_ranks=pp, micro_batches=m, stages_per_rank=v)
            return _Pipeline(micro_batches=m, samples=(schedule,), counts=stage_counts(schedule))
        samples = tuple(
            make_schedule(name, num_ranks=pp, micro_batches=k * pp, stages_per_rank=v)
            for k in _SAMPLED
        )
        low, high = (stage_counts(sample) for sample in samples)
        return _Pipeline(
            micro_batches=m,
            samples=samples,
            counts=StageCounts(
                before=_extend(low.before, high.before, m, pp),
                after=_extend(low.after, high.after, m, pp),
            ),
        )

    @functools.cache  # noqa: B019
    def boundaries(self, stages: int) -> tuple[int, ...]:
        partition: Partition = partition_model(
            self.specs, method="balanced", num_stages=stages, seq_len=self.request.seq_len
        )
        return partition.boundaries

    @functools.cache  # noqa: B019
    def run(self, schedule: Schedule, stages: tuple[StageTimes, ...], p2p: float) -> SimResult:
        """Candidates that differ only in their data-parallel tails share one simulation."""
        return simulate_stages(self.lowered(schedule), stages, p2p=p2p)

    @functools.cache  # noqa: B019
    def lowered(self, schedule: Schedule) -> Schedule:
        return add_communication(schedule)

    def pipeline(self, c: Candidate) -> _Pipeline:
        return self.schedule(c.schedule, c.mesh.pp, c.micro_batches, c.stages_per_rank)

    def sums(self, c: Candidate) -> LayerBytes:
        r = self.request
        states = StateLayout(
            dp=c.mesh.dp,
            zero=c.zero,
            zero_reshard=c.zero_reshard,
            tp=c.mesh.tp,
            block=CUDA_BLOCK if r.device == "cuda" else 1,
            optimizer_impl="per_tensor" if c.zero == 3 else "fused",
            device=r.device,
        )
        return layer_bytes(
            self.specs,
            seq_len=r.seq_len,
            precision=r.precision,
            device=r.device,
            tp=c.mesh.tp,
            split=c.split,
            states=states,
        )

    @functools.cache  # noqa: B019
    def forward(self, mbs: int, tp: int) -> tuple[float, ...]:
        """Seconds of each layer's forward for one micro-batch on one device."""
        measured = self.request.measured
        if measured is not None:
            return tuple(t / tp for t in measured[mbs])
        rate = self.request.hardware.achieved_flops
        return tuple(mbs * f / tp / rate for f in self.flops)


def _fit(
    search: _Search, c: Candidate, budget: int
) -> tuple[Candidate, tuple[int, ...], tuple[int, ...], tuple[int, ...]] | int:
    """The candidate with the least recompute that fits, with its boundaries and per-stage and
    per-rank peaks; else the lowest peak it reaches (everything recomputed)."""
    pipeline = search.pipeline(c)
    schedule, counts = pipeline.shape, pipeline.counts
    bounds = search.boundaries(schedule.num_stages)
    sums = search.sums(c)

    def peaks(recomputed: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        chosen = set(recomputed)
        return rank_peaks(
            sums,
            schedule,
            counts,
            bounds,
            micro_batches=c.micro_batches,
            micro_batch_size=c.micro_batch_size,
            recomputed=[s in chosen for s in range(schedule.num_stages)],
            reduce_copy=c.mesh.dp > 1 and c.zero == 0,
        )

    every = tuple(range(schedule.num_stages))
    tried: list[tuple[int, ...]] = [()]
    stages, ranks = peaks(())
    if max(ranks) > budget and not c.split:  # a split backward's W keeps what I recomputed
        over = [r for r, peak in enumerate(ranks) if peak > budget]
        some = tuple(sorted(s for r in over for s in schedule.stages_of(r)))
        tried = [some, every] if some != every else [every]
    for recompute in tried:
        stages, ranks = peaks(recompute)
        if max(ranks) <= budget:
            chosen = Candidate(**{**c.__dict__, "recompute": recompute})
            return chosen, bounds, stages, ranks
    return max(ranks)


def _stage_costs(
    search: _Search, c: Candidate, layers: Sequence[range], params: Sequence[float]
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
                zero_turn=turn,
            )
        )
    return stages


def _screen(search: _Search, c: Candidate, bounds: Sequence[int]) -> _Screened:
    """Action costs, transfers, data-parallel tails and the step's lower bound."""
    r, hw, mesh = search.request, search.request.hardware, c.mesh
    schedule = search.pipeline(c).shape
    hidden_bytes = c.micro_batch_size * r.seq_len * search.hidden * search.size
    layers = [range(bounds[s], bounds[s + 1]) for s in range(schedule.num_stages)]
    params = [sum(search.params[i] for i in stage) / mesh.tp for stage in layers]
    width = (mesh.dp - 1) * mesh.tp + 1
    stages = _stage_costs(search, c, layers, params)
    tails = tuple(
        dp_tail(
            sum(params[s] for s in schedule.stages_of(rank)),
            size=search.size,
            dp=mesh.dp,
            zero=c.zero,
            reshard=c.zero_reshard,
            hardware=hw,
            width=width,
        )
        for rank in range(mesh.pp)
    )
    p2p = 0.0
    if mesh.pp > 1:
        p2p = hidden_bytes / mesh.tp / hw.bandwidth(mesh.dp * mesh.tp + 1) + hw.latency
    # the last rank waits for the first micro-batch to pass every rank before it
    fill = (mesh.pp - 1) * (min(s.forward for s in stages) + p2p)
    bound = max(
        c.micro_batches * sum(stages[s].forward + stages[s].backward for s in schedule.stages_of(k))
        + tails[k]
        + (fill if k == mesh.pp - 1 else 0.0)
        for k in range(mesh.pp)
    )
    return _Screened(
        candidate=c,
        boundaries=tuple(bounds),
        stages=tuple(stages),
        p2p=p2p,
        tails=tails,
        bound=bound,
        stage_peaks=(),
        rank_peaks=(),
    )


def _costs(search: _Search, s: _Screened) -> tuple[float, float]:
    """(communication, recompute) seconds of the busiest rank's step."""
    c = s.candidate
    schedule = search.pipeline(c).shape
    comm, recompute = 0.0, 0.0
    for rank in range(c.mesh.pp):
        mine = schedule.stages_of(rank)
        transfers = 2 * (c.mesh.pp - 1) * c.stages_per_rank * s.p2p
        turns = sum(s.stages[k].tp_comm for k in mine) * c.micro_batches
        comm = max(comm, s.tails[rank] + turns + transfers)
        recompute = max(recompute, c.micro_batches * sum(s.stages[k].recompute for k in mine))
    return comm, recompute


def _predict(search: _Search, s: _Screened, timed: Timed | None) -> Prediction:
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
        simulated=timed.result if timed is not None else None,
    )


def _simulate(search: _Search, s: _Screened) -> Timed:
    """The step simulated, or extended from its two samples (`_SAMPLED`)."""
    pipeline = search.pipeline(s.candidate)
    timed = [with_tails(search.run(x, s.stages, s.p2p), s.tails) for x in pipeline.samples]
    if len(timed) == 1:
        return timed[0]
    low, high = timed
    pp, m = pipeline.shape.num_ranks, pipeline.micro_batches
    per_micro_batch = (high.step - low.step) / pp
    step = low.step + per_micro_batch * (m - _SAMPLED[0] * pp)
    busy = sum(high.result.busy) * m / (_SAMPLED[1] * pp)
    return Timed(step=step, bubble=1 - busy / (pp * step), result=high.result)


def _loss(plan: Prediction, best: Prediction) -> str:
    """What cost `plan` most against `best`: communication, recompute, or else idle time."""
    comm = plan.communication - best.communication
    recompute = plan.recompute - best.recompute
    rest = plan.step_time - best.step_time - comm - recompute
    reasons = {"more bubble": rest, "more communication": comm, "more recompute": recompute}
    return max(reasons, key=lambda k: reasons[k])


@dataclass(frozen=True, kw_only=True)
class _Screen:
    survivors: list[_Screened]
    considered: int
    over: int
    least: float
    """The lowest peak of a candidate over the budget (inf when none was)."""


def _screen_all(state: _Search) -> _Screen:
    """Every candidate of every mesh through the memory screen; the survivors costed."""
    request = state.request
    survivors: list[_Screened] = []
    considered, over, least = 0, 0, math.inf
    for mesh in meshes(
        request.model,
        request.devices,
        num_layers=len(state.specs),
        seq_len=request.seq_len,
        gpus_per_node=request.hardware.gpus_per_node,
    ):
        for c in _mesh_candidates(state, mesh):
            considered += 1
            fitted = _fit(state, c, request.device_memory)
            if isinstance(fitted, int):
                over, least = over + 1, min(least, fitted)
                continue
            chosen, bounds, stage_peaks, peaks = fitted
            found = _screen(state, chosen, bounds)
            survivors.append(replace(found, stage_peaks=stage_peaks, rank_peaks=peaks))
    return _Screen(survivors=survivors, considered=considered, over=over, least=least)


def search(request: PlanRequest, progress: Callable[[int, int], None] | None = None) -> PlanResult:
    """The best `request.top` layouts, and why every other candidate lost."""
    state = _Search(request)
    screen = _screen_all(state)
    ranked = _rank(state, screen.survivors, progress)
    losses = dict.fromkeys(LOSSES, 0)
    losses["over memory"] = screen.over + len(ranked.over)
    decided = {id(p.candidate) for p in (*ranked.best, *ranked.over)}
    for plan in ranked.plans:
        if id(plan.candidate) not in decided:
            losses[_loss(plan, ranked.best[0] if ranked.best else plan)] += 1
    least = min([screen.least, *(max(p.rank_peaks) for p in ranked.over)])
    return PlanResult(
        request=request,
        plans=ranked.best,
        considered=screen.considered,
        losses=losses,
        least_memory=None if ranked.best or least == math.inf else int(least),
    )


def _replayed(request: PlanRequest, plan: Prediction) -> Prediction:
    """The plan with the exact replay's peaks (`estimate_memory`, as `meshpipe memory`
    prints them)."""
    fields = layout_fields(request, plan.candidate, plan.boundaries)
    report = estimate_memory(MemoryConfig.of(device=request.device, **fields))
    stages = tuple(s.peak for s in report.stages)
    return replace(plan, stage_peaks=stages, rank_peaks=report.rank_peaks)


def predict(request: PlanRequest, candidate: Candidate) -> Prediction:
    """One given layout's prediction (balanced boundaries, its own recompute), memory by the
    fast screen: what the search computes for each candidate, for comparing a hand choice."""
    state = _Search(request)
    pipeline = state.pipeline(candidate)
    bounds = state.boundaries(pipeline.shape.num_stages)
    stage_peaks, peaks = rank_peaks(
        state.sums(candidate),
        pipeline.shape,
        pipeline.counts,
        bounds,
        micro_batches=candidate.micro_batches,
        micro_batch_size=candidate.micro_batch_size,
        recomputed=[s in candidate.recompute for s in range(pipeline.shape.num_stages)],
        reduce_copy=candidate.mesh.dp > 1 and candidate.zero == 0,
    )
    screened = replace(_screen(state, candidate, bounds), stage_peaks=stage_peaks, rank_peaks=peaks)
    return _predict(state, screened, _simulate(state, screened))


def _mesh_candidates(state: _Search, mesh: Mesh) -> list[Candidate]:
    request = state.request
    found = []
    for c in candidates(
        mesh,
        global_batch=request.global_batch,
        num_layers=len(state.specs),
        micro_batch_sizes=request.micro_batch_sizes,
        schedules=request.schedules,
    ):
        try:
            state.pipeline(c)
        except ValueError:
            continue
        found.append(c)
    return found


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
    state: _Search, screened: list[_Screened], progress: Callable[[int, int], None] | None
) -> _Ranked:
    """Survivors simulated in the order of their lower bound while it could still enter the
    best `top`, each that would enter replayed exactly (`_replayed`); the rest at their bound."""
    top = state.request.top
    order = sorted(screened, key=lambda s: s.bound)
    best: dict[tuple[object, ...], Prediction] = {}
    plans: list[Prediction] = []
    over: list[Prediction] = []
    for done, s in enumerate(order):
        if progress is not None:
            progress(done + 1, len(order))
        worst = max(p.step_time for p in best.values()) if len(best) == top else math.inf
        if s.bound >= worst:
            plans.append(_predict(state, s, None))
            continue
        plan = _predict(state, s, _simulate(state, s))
        plans.append(plan)
        known = best.get(_key(plan.candidate))
        entering = plan.step_time < worst and (known is None or plan.step_time < known.step_time)
        if not entering or len(over) + len(best) >= _REPLAYS:
            continue
        exact = _replayed(state.request, plan)
        if max(exact.rank_peaks) > state.request.device_memory:
            over.append(exact)
            continue
        best[_key(plan.candidate)] = exact
        if len(best) > top:
            del best[max(best, key=lambda k: best[k].step_time)]
    chosen = tuple(sorted(best.values(), key=lambda p: p.step_time))
    return _Ranked(plans=plans, best=chosen, over=over)
