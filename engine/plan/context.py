"""The search's shared state: schedules (or their two samples, extended), in-flight
counts (`engine.plan.count_store`), boundaries, per-layer bytes and times, and simulations, each
computed once."""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from engine.memory.fitting import layer_requests
from engine.memory.states import StateLayout, dp_bucket_copy, stage_params
from engine.memory.trace_store import TraceRequest
from engine.memory.tracker import CUDA_BLOCK
from engine.plan.budget import highest_stage_floor
from engine.plan.candidates import Candidate
from engine.plan.count_store import CountKey, CountStore
from engine.plan.counts import StageCounts, State, stage_counts
from engine.plan.layer_bytes import LayerBytes, layer_bytes, layer_shape, state_sums
from engine.plan.programs import Programs
from engine.plan.request import PlanRequest
from engine.plan.timing import (
    StageTimes,
    input_share,
    layer_flops,
    simulate_stages,
    stages_timeline,
    time_program,
)
from engine.schedule import Schedule, SimResult, SimTimes, make_schedule, own_placement
from engine.schedule.generated_arrays import schedule_arrays
from engine.schedule.passes import as_lowered
from engine.schedule.schedule import stages_by_rank
from models import LayerSpec, get_config, layer_specs
from partitioners import Partition, partition_model

__all__ = [
    "COUNT_SAMPLES",
    "FLOOR_ROUNDS",
    "SAMPLED",
    "TIME_SAMPLES",
    "CountKey",
    "Pipeline",
    "SearchContext",
]

SAMPLED = (3, 4)
"""Beyond 4 micro-batches per pipeline rank, a schedule is built and simulated with 3 and 4
per rank and extended linearly: past its warm-up a schedule repeats one pattern per
micro-batch, so its step time, busy time and in-flight counts grow (or stay) linearly.
Schedules whose warm-up ends sooner are sampled sooner (`COUNT_SAMPLES`, `TIME_SAMPLES`)."""

COUNT_SAMPLES = {
    "gpipe": (1, 2),
    **dict.fromkeys(("1f1b", "zb_h1", "zb_h2", "v_half", "v_min", "looped_bfs"), (2, 3)),
}
"""Micro-batches per rank from which a schedule's in-flight counts extend exactly to every
longer step, where `SAMPLED` is more than they need: a search counts hundreds of schedules,
most of them samples of 64 or 128 ranks, and samples of 2 and 3 per rank are 5/7 of the
actions of 3 and 4. Tested for every schedule and every count
(`test_a_long_steps_counts_are_extended_exactly_from_their_samples`): interleaved 1F1B,
ZB-drain and DualPipeV settle at 3 per rank, ZB-V's split pairs (awaiting I, awaiting W) too."""

TIME_SAMPLES = {**dict.fromkeys(("gpipe", "v_min"), (1, 2)), "looped_bfs": (2, 3)}
"""Micro-batches per rank whose simulated step extends to one of more than `SAMPLED`'s as
closely as `SAMPLED`'s do (tested within half a percent under uneven stages); the other
schedules' steps extended from fewer miss by up to 3 %."""


FLOOR_ROUNDS = {"interleaved_1f1b": 2, "dualpipe_v": 2}
"""Micro-batches per rank from which a schedule's in-flight counts only grow with more (1
elsewhere): interleaved 1F1B at one per rank runs as GPipe, DualPipeV needs two. Tested for
every schedule (`test_counts_grow_with_the_micro_batches_from_the_floor_rounds`)."""


def _lengths(pp: int, m: int, samples: tuple[int, int] = SAMPLED) -> tuple[int, ...]:
    """The lengths a pipeline of `m` micro-batches is counted or simulated at: its own, or
    the two `samples` per rank it is extended from."""
    return (m,) if m <= samples[1] * pp else tuple(k * pp for k in samples)


def _count_lengths(name: str, pp: int, m: int) -> tuple[int, ...]:
    return _lengths(pp, m, COUNT_SAMPLES.get(name, SAMPLED))


def _time_lengths(name: str, pp: int, m: int) -> tuple[int, ...]:
    """A step of up to `SAMPLED`'s longer length is simulated whole (exact), however soon
    its schedule settles."""
    return (m,) if m <= SAMPLED[1] * pp else _lengths(pp, m, TIME_SAMPLES.get(name, SAMPLED))


def _fewest(c: Candidate) -> int:
    """The candidate's fewest micro-batches (`FLOOR_ROUNDS` per rank), whose counts bound its
    own from below."""
    return FLOOR_ROUNDS.get(c.schedule, 1) * c.mesh.pp


def _count_in_worker(key: CountKey) -> StageCounts:
    """One schedule's counts, in a worker (`CountStore.ahead`)."""
    return stage_counts(schedule_arrays(*key))


def _extend(
    low: Sequence[int], high: Sequence[int], m: int, lengths: Sequence[int]
) -> tuple[int, ...]:
    """Counts at `m` micro-batches from those at the two sample `lengths` (a rank apart)."""
    k, step = lengths[0], lengths[1] - lengths[0]
    return tuple(a + (b - a) * (m - k) // step for a, b in zip(low, high, strict=True))


def _settled(
    low: frozenset[State] | None, high: frozenset[State] | None
) -> frozenset[State] | None:
    """A rank's states together at more micro-batches than the samples have: the samples'
    where they agree; the longer one's where they differ only in which stages' gradients
    exist (at 3 per rank, DualPipeV reaches one state before a stage's first backward that it
    reaches after it from 4 on); None (unknown) where their stashes differ."""
    if low is None or high is None or low == high:
        return low if low == high else None
    columns = 3 * len(next(iter(high), ())) // 4
    stashes = ({state[:columns] for state in states} for states in (low, high))
    return high if next(stashes) == next(stashes) else None


def _tied_layers(specs: Sequence[LayerSpec]) -> dict[str, tuple[tuple[int, ...], int]]:
    """Per tie key (GPT-2's embedding and head), the layers holding a copy of the weight and
    its parameter count."""
    ties: dict[str, tuple[tuple[int, ...], int]] = {}
    for i, spec in enumerate(specs):
        if spec.tie_key is None or spec.tied_param is None:
            continue
        held, numel = ties.get(spec.tie_key, ((), 0))
        if not numel:
            numel = spec.build("meta").get_parameter(spec.tied_param).numel()
        ties[spec.tie_key] = ((*held, i), numel)
    return ties


@dataclass(frozen=True, kw_only=True)
class Pipeline:
    """A schedule as the search uses it: its placement and in-flight counts, known without
    its rows (`SearchContext.counts`); the rows, its own or its two samples' to extend from
    (`lengths`), are built only for a simulation (`SearchContext.samples`)."""

    name: str
    micro_batches: int
    placement: tuple[int, ...]
    lengths: tuple[int, ...]
    """Micro-batches of the schedules built to simulate it: its own, or two samples
    (`TIME_SAMPLES`)."""
    counts: StageCounts

    @property
    def num_ranks(self) -> int:
        return max(self.placement) + 1

    @property
    def num_stages(self) -> int:
        return len(self.placement)

    @property
    def stages_per_rank(self) -> int:
        return self.num_stages // self.num_ranks

    def rank_of(self, stage: int) -> int:
        return self.placement[stage]

    def stages_of(self, rank: int) -> tuple[int, ...]:
        return self._stages_by_rank[rank]

    @functools.cached_property
    def _stages_by_rank(self) -> tuple[tuple[int, ...], ...]:
        return stages_by_rank(self.placement, self.num_ranks)


class SearchContext:
    """What every candidate of one request shares, computed once: schedules and their
    in-flight counts, boundaries, per-layer bytes, forward times, simulations."""

    def __init__(self, request: PlanRequest) -> None:
        self.request = request
        self.specs = tuple(layer_specs(request.model))
        self.hidden = int(get_config(request.model).d_model)
        self.size = 4 if request.precision == "fp32" else 2
        self.params = tuple(spec.num_parameters() for spec in self.specs)
        self.tensors = len(stage_params(self.specs))
        """Parameter tensors of the whole model, a tied one once: the global norm's length."""
        self.flops = tuple(layer_flops(spec, request.seq_len) for spec in self.specs)
        self.ties = _tied_layers(self.specs)
        self._counts = CountStore(_count_in_worker)
        self.programs = Programs()
        """The schedules simulated, compiled (ahead, in the workers: `search._rank`)."""

    @functools.cache  # noqa: B019 (one search, then dropped)
    def schedule(self, name: str, pp: int, m: int, v: int) -> Pipeline:
        placement = own_placement(name, pp, v)
        lengths, counted = _time_lengths(name, pp, m), _count_lengths(name, pp, m)
        pipeline = functools.partial(
            Pipeline, name=name, micro_batches=m, placement=placement, lengths=lengths
        )
        if counted == (m,):
            return pipeline(counts=self.counts(name, pp, m, v))
        low, high = (self.counts(name, pp, k, v) for k in counted)
        return pipeline(
            counts=StageCounts(
                before=_extend(low.before, high.before, m, counted),
                after=_extend(low.after, high.after, m, counted),
                together=tuple(map(_settled, low.together, high.together)),
                sent_back=_extend(low.sent_back, high.sent_back, m, counted),
                fused=tuple(a and b for a, b in zip(low.fused, high.fused, strict=True)),
                awaiting=low.awaiting if low.awaiting == high.awaiting else (),
                warm=_extend(low.warm, high.warm, m, counted),
            ),
        )

    def counts(self, name: str, pp: int, m: int, v: int) -> StageCounts:
        """A schedule's in-flight counts (`CountStore`: held, from the workers, on disk, or
        counted here from its rows as arrays, never built: `schedule_arrays`)."""
        key = (name, pp, m, v)
        return self._counts.get(key, lambda: stage_counts(schedule_arrays(*key)))

    def count_ahead(
        self, keys: Iterable[CountKey], progress: Callable[[int, int], None] | None = None
    ) -> None:
        """`CountStore.ahead`: inside a search, handed to its workers and taken as `counts`
        asks for them (`stop_counting` after)."""
        self._counts.ahead(keys, progress)

    def stop_counting(self) -> None:
        self._counts.stop()

    def count_keys(self, c: Candidate) -> list[CountKey]:
        """The schedules whose counts `pipeline` and `floor_pipeline` read for `c`."""
        name, pp, v = c.schedule, c.mesh.pp, c.stages_per_rank
        lengths = list(_count_lengths(name, pp, c.micro_batches))
        if c.micro_batches > _fewest(c):
            lengths = [*_count_lengths(name, pp, _fewest(c)), *lengths]  # the screen reads it first
        return [(name, pp, m, v) for m in lengths]

    @functools.cache  # noqa: B019
    def built(self, name: str, pp: int, m: int, v: int) -> Schedule:
        return make_schedule(name, num_ranks=pp, micro_batches=m, stages_per_rank=v)

    def samples(self, pipeline: Pipeline) -> tuple[Schedule, ...]:
        """The schedules a pipeline's simulation runs: its own, or its two samples."""
        return tuple(self.built(*key) for key in self.sample_keys(pipeline))

    def sample_keys(self, pipeline: Pipeline) -> tuple[CountKey, ...]:
        """`samples`' keys (name, ranks, micro-batches, stages per rank), none built."""
        name, pp, v = pipeline.name, pipeline.num_ranks, pipeline.stages_per_rank
        return tuple((name, pp, m, v) for m in pipeline.lengths)

    @functools.cache  # noqa: B019
    def boundaries(self, stages: int) -> tuple[int, ...]:
        partition: Partition = partition_model(
            self.specs, method="balanced", num_stages=stages, seq_len=self.request.seq_len
        )
        return partition.boundaries

    @functools.cache  # noqa: B019
    def run(
        self, key: CountKey, stages: tuple[StageTimes, ...], p2p: float, slots: float = math.inf
    ) -> SimTimes:
        """Candidates that differ only in their data-parallel tails share one simulation. The
        schedules are the generators', valid by their tests, simulated compute-only as
        compiled (`programs`; `simulate_times` adds the communication lowering would), on
        `slots` cores per pipeline rank (`time_program`)."""
        times = time_program(self.programs.of(key), stages, p2p=p2p, slots=slots)
        if times is None:
            simulate_stages(self.built(*key), stages, p2p=p2p)  # raises the deadlock
            raise AssertionError(f"the simulation of {key} stalled where simulate runs through")
        return times

    def timeline(
        self,
        schedule: Schedule,
        stages: tuple[StageTimes, ...],
        p2p: float,
        slots: float = math.inf,
    ) -> SimResult:
        """`run` with the timeline a plan's figure draws: for the plans shown, not searched."""
        return stages_timeline(as_lowered(schedule), stages, p2p=p2p, slots=slots)

    def pipeline(self, c: Candidate) -> Pipeline:
        return self.schedule(c.schedule, c.mesh.pp, c.micro_batches, c.stages_per_rank)

    def floor_pipeline(self, c: Candidate) -> Pipeline | None:
        """The candidate's schedule at its fewest micro-batches (`FLOOR_ROUNDS` per rank),
        whose in-flight counts are at most its own; None where that is not fewer."""
        if c.micro_batches <= _fewest(c):
            return None
        return self.schedule(c.schedule, c.mesh.pp, _fewest(c), c.stages_per_rank)

    def layout(self, c: Candidate) -> StateLayout:
        """How the candidate's replica holds its model states."""
        return StateLayout(
            dp=c.mesh.dp,
            zero=c.zero,
            zero_reshard=c.zero_reshard,
            tp=c.mesh.tp,
            block=CUDA_BLOCK if self.request.device == "cuda" else 1,
            optimizer_impl="per_tensor" if c.zero == 3 else "fused",
            device=self.request.device,
        )

    def sums(self, c: Candidate) -> LayerBytes:
        return self._sums(self.layout(c), c.split)

    @functools.cache  # noqa: B019
    def _sums(self, states: StateLayout, split: bool) -> LayerBytes:
        r = self.request
        return layer_bytes(
            self.specs,
            seq_len=r.seq_len,
            precision=r.precision,
            device=r.device,
            tp=states.tp,
            split=split,
            states=states,
        )

    def layer_requests(self, states: StateLayout, split: bool) -> list[TraceRequest]:
        """The traces `sums` reads for a layout (for `trace_ahead`)."""
        r = self.request
        shape = layer_shape(
            self.specs, seq_len=r.seq_len, precision=r.precision, tp=states.tp, states=states
        )
        styles = ((True,), (False,)) if split else ((False,),)
        return [q for style in styles for q in layer_requests(self.specs, shape, r.device, style)]

    @functools.cache  # noqa: B019
    def state_sums(self, states: StateLayout) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Per layout, prefix sums of each layer's fixed states and gradients (no trace)."""
        return state_sums(self.specs, states, self.request.precision)

    @functools.cache  # noqa: B019
    def stage_floors(self, states: StateLayout, stages: int, twice: bool) -> tuple[int, int | None]:
        """Of the balanced split into `stages`: stage 0's states and gradients (with, where
        `twice`, the dp all-reduce's flat bucket made beside them: a copy of at most one
        bucket), and the most of any later stage's, None for a single stage."""
        fixed, grads = self.state_sums(states)
        bounds = self.boundaries(stages)
        each = []
        for a, b in itertools.pairwise(bounds):
            gradients = grads[b] - grads[a]
            copy = dp_bucket_copy(gradients) if twice else 0
            each.append(fixed[b] - fixed[a] + gradients + copy)
        return each[0], max(each[1:], default=None)

    @functools.cache  # noqa: B019
    def peak_floor(
        self,
        states: StateLayout,
        split: bool,
        stages: int,
        micro_batch_size: int,
        *,
        reduce_copy: bool,
        several: bool,
        recompute_runs: tuple[int, ...],
    ) -> int:
        """Of the balanced split into `stages`: `highest_stage_floor`, a bound of
        the peak under any schedule and recompute, without a schedule built."""
        return highest_stage_floor(
            self._sums(states, split),
            self.boundaries(stages),
            micro_batch_size=micro_batch_size,
            reduce_copy=reduce_copy,
            recompute_runs=recompute_runs,
            several=several,
        )

    @functools.cache  # noqa: B019
    def input_shares(self, mbs: int) -> tuple[float, ...]:
        """Of each layer's backward, the share a split backward runs at I: measured
        (`profile.measured_input_shares`) or by FLOPs (`timing.input_share`)."""
        measured = self.request.measured_input_shares
        if measured is not None and mbs in measured:
            return measured[mbs]
        return tuple(input_share(spec, self.request.seq_len) for spec in self.specs)

    @functools.cache  # noqa: B019
    def forward(self, mbs: int, tp: int) -> tuple[float, ...]:
        """Seconds of each layer's forward for one micro-batch on one device."""
        measured, split = self.request.measured, self.request.measured_split
        if split is not None and (mbs, tp) in split:
            return split[mbs, tp]
        if measured is not None:
            return tuple(t / tp for t in measured[mbs])
        rate = self.request.hardware.achieved_flops
        return tuple(mbs * f / tp / rate for f in self.flops)
