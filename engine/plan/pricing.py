"""One candidate that fits, priced (`engine.plan.search` ranks them): each stage's action
costs, the transfers, each rank's data-parallel tail and optimizer update, the step's lower
bound (its busiest rank's work, no bubble), and the step simulated from those, or extended
from its two samples; the prediction the planner prints.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass, replace

from engine.plan.candidates import Candidate
from engine.plan.context import Pipeline, SearchContext
from engine.plan.hardware import all_reduce_time
from engine.plan.request import Prediction
from engine.plan.timing import StageTimes, Timed, dp_tail, stage_times, with_tails

__all__ = [
    "Priced",
    "norm_syncs",
    "prediction",
    "priced",
    "simulated_step",
    "tie_sums",
    "with_timeline",
]


@dataclass(frozen=True, kw_only=True)
class Priced:
    """A candidate that fits, with what timing it needs: each stage's action costs, the
    transfer delay, each rank's tail and update, and the step's lower bound."""

    candidate: Candidate
    boundaries: tuple[int, ...]
    stages: tuple[StageTimes, ...]
    p2p: float
    tails: tuple[float, ...]
    """Per rank, its communication after its last backward: the sum of tied weights'
    gradients across the pipeline and the data-parallel reduction."""
    updates: tuple[float, ...]
    """Per rank, its optimizer phase after the tail: the global norm's all-reduces
    (`norm_syncs`), then its clipping and update (of its shard under ZeRO)."""
    bound: float
    stage_peaks: tuple[int, ...]
    rank_peaks: tuple[int, ...]

    @property
    def after(self) -> tuple[float, ...]:
        """Per rank, its seconds after its last backward: the tail, then the update."""
        return tuple(tail + update for tail, update in zip(self.tails, self.updates, strict=True))


def _stage_costs(
    search: SearchContext, c: Candidate, layers: Sequence[range], params: Sequence[float]
) -> list[StageTimes]:
    """Each stage's action costs: compute, tp all-reduces, ZeRO-3's per-micro-batch turns."""
    r, hw, mesh = search.request, search.request.hardware, c.mesh
    forward = search.forward(c.micro_batch_size, mesh.tp)
    hidden_bytes = c.micro_batch_size * r.seq_len * search.hidden * search.size
    dp_width = (mesh.dp - 1) * mesh.tp + 1
    stages = []
    for s, stage in enumerate(layers):
        turn = (0.0, 0.0)
        if c.zero == 3 and c.zero_reshard == "micro-batch":
            gather = hw.all_gather(search.size * params[s], mesh.dp, dp_width)
            scatter = hw.reduce_scatter(4 * params[s], mesh.dp, dp_width)
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


def tie_sums(
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


def norm_syncs(search: SearchContext, c: Candidate) -> float:
    """Seconds of the all-reduces every rank's global gradient norm waits for
    (`engine.runtime.gradients.StepGradients`): the per-parameter norms summed over the
    pipeline, over the replicas where ZeRO-2/3 shard the gradients, and over the tp group
    where it splits them. A few fp32 per parameter tensor: the link's latency, mostly (gloo
    between this host's processes: 2.2 ms for gpt-bench's 132 at pp 2, docs/BENCHMARKS.md)."""
    hw, mesh = search.request.hardware, c.mesh
    groups = [(mesh.tp, mesh.tp)]
    if mesh.pp > 1:
        groups.append((mesh.pp, (mesh.pp - 1) * mesh.dp * mesh.tp + 1))
    if c.zero in (2, 3):
        groups.append((mesh.dp, (mesh.dp - 1) * mesh.tp + 1))
    vector = 4 * search.tensors
    return sum(all_reduce_time(vector, n, hw.bandwidth(w), hw.latency) for n, w in groups)


def priced(search: SearchContext, c: Candidate, bounds: Sequence[int]) -> Priced:
    """Action costs, transfers, data-parallel tails and the step's lower bound."""
    r, hw, mesh = search.request, search.request.hardware, c.mesh
    pipeline = search.pipeline(c)
    hidden_bytes = c.micro_batch_size * r.seq_len * search.hidden * search.size
    layers = [range(bounds[s], bounds[s + 1]) for s in range(pipeline.num_stages)]
    params = [sum(search.params[i] for i in stage) / mesh.tp for stage in layers]
    width = (mesh.dp - 1) * mesh.tp + 1
    stages = _stage_costs(search, c, layers, params)
    ties = tie_sums(search, c, pipeline, bounds)
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
    syncs = norm_syncs(search, c)
    updates = tuple(syncs + hw.update_time(rank_params / shards) for rank_params in held)
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
    return Priced(
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


def _costs(search: SearchContext, s: Priced) -> tuple[float, float]:
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


def prediction(search: SearchContext, s: Priced, timed: Timed | None) -> Prediction:
    """The screened candidate's prediction, timed by the simulator or else at its bound; its
    timeline is drawn for the plans shown only (`with_timeline`)."""
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


def with_timeline(search: SearchContext, s: Priced, plan: Prediction) -> Prediction:
    """The plan with its simulated timeline: the step's, or its longer sample's."""
    sample = search.samples(search.pipeline(s.candidate))[-1]
    timeline = search.timeline(sample, s.stages, s.p2p, _slots(search, s.candidate))
    return replace(plan, simulated=timeline, tails=s.after)


def _slots(search: SearchContext, c: Candidate) -> float:
    """The host cores each of the candidate's pipeline ranks comes to (`Hardware.slots`)."""
    return search.request.hardware.slots(c.mesh.dp * c.mesh.tp)


def simulated_step(search: SearchContext, s: Priced) -> Timed:
    """The step simulated, or extended from its two samples (`Pipeline.lengths`)."""
    pipeline = search.pipeline(s.candidate)
    samples = search.sample_keys(pipeline)
    slots = _slots(search, s.candidate)
    timed = [with_tails(search.run(x, s.stages, s.p2p, slots), s.after) for x in samples]
    if len(timed) == 1:
        return timed[0]
    (low, high), (shorter, longer) = timed, pipeline.lengths
    pp, m = pipeline.num_ranks, pipeline.micro_batches
    per_micro_batch = (high.step - low.step) / (longer - shorter)
    step = low.step + per_micro_batch * (m - shorter)
    busy = high.busy * m / longer
    return Timed(step=step, bubble=1 - busy / (pp * step), busy=busy)
