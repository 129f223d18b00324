"""What to change when a layout does not fit: alternatives, each one re-estimated.

Candidates: recompute the forward (on every stage, or only on those over), a higher ZeRO
level, the same devices split otherwise (twice the stages or the tensor-parallel width for half
the replicas), a memory-balanced partition (boundaries chosen against per-layer memory, each
stage weighted by its in-flight micro-batches), more pipeline stages, smaller micro-batches.
Every candidate runs through `estimate_memory`, so a suggestion is what the estimator predicts,
not a rule of thumb, and only candidates the estimator puts below the layout's own peak are offered.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from itertools import accumulate

from engine.config import ZERO_LEVELS, replace_flat
from engine.memory.estimate import (
    MemoryConfig,
    MemoryReport,
    estimate_memory,
    resolve,
    stage_memory,
)
from engine.memory.fitting import held_with_gradients, layer_sums
from engine.memory.replay import in_flight, stage_actions
from engine.schedule.generators import make_schedule
from partitioners import Partition

__all__ = [
    "Suggestion",
    "held_with_gradients",
    "layer_memory",
    "memory_balanced",
    "states_floor",
    "suggest",
]


@dataclass(frozen=True, kw_only=True)
class Suggestion:
    """One alternative layout and what the estimator predicts for it."""

    change: str
    """The flags that differ from the command that was run."""
    report: MemoryReport
    note: str = ""
    """A caveat, such as an engine feature the change needs."""


_PerLayer = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]


def layer_memory(config: MemoryConfig) -> _PerLayer:
    """Per layer: bytes of its weights, gradients and AdamW states; bytes one of its forwards
    keeps until the backward (traced alone, less the input it received); and bytes of its
    low-precision weight copies (one per step, whatever is in flight)."""
    alone = replace_flat(
        config, pp=1, stages_per_rank=1, partition="uniform", recompute_stages=None
    )
    return _layer_memory(alone)


def _layer_memory(config: MemoryConfig) -> _PerLayer:
    layout = resolve(config)
    sums = layer_sums(layout.specs, layout.shape(config, 0), config.device)
    states = tuple(s + g for s, g in zip(sums.states, sums.grads, strict=True))
    return states, sums.kept, sums.copies


def memory_balanced(
    states: Sequence[int],
    kept: Sequence[int],
    weights: Sequence[int],
    *,
    grads: Sequence[int] | None = None,
    after: Sequence[int] | None = None,
) -> Partition:
    """Contiguous stages minimising the largest
    `sum(states) + max(weights[s] · sum(kept), sum(grads) + after[s] · sum(kept))`.

    `weights[s]` is stage s's in-flight peak (1F1B's stage s holds P - s micro-batches), which
    `partitioners.balanced` cannot express; an exact dynamic program over (stages, layers
    covered) can, in O(S·L²). Ties go to the earliest boundary. With `grads` (then left out
    of `states`) and `after[s]`, the micro-batches stage s holds once its gradients exist, a
    stage that runs all its forwards before its first backward is not charged its gradients
    on top of all its stashes: they never coexist. Without them: `sum(states) + w · sum(kept)`.
    """
    num_layers, num_stages = len(states), len(weights)
    grads = [0] * num_layers if grads is None else grads
    after = weights if after is None else after
    if len(kept) != num_layers or len(grads) != num_layers or len(after) != num_stages:
        raise ValueError(
            f"{num_layers} states, {len(kept)} kept sizes, {len(grads)} gradient sizes, "
            f"{num_stages} stage weights and {len(after)} later weights: give one state, kept "
            "and gradient size per layer and one weight and later weight per stage"
        )
    if not 1 <= num_stages <= num_layers:
        raise ValueError(
            f"{num_stages} stages for {num_layers} layers: give at most one stage per layer"
        )
    ps, pk, pg = (list(accumulate(v, initial=0)) for v in (states, kept, grads))

    def cost(s: int, a: int, end: int) -> int:
        k = pk[end] - pk[a]
        return ps[end] - ps[a] + max(weights[s] * k, pg[end] - pg[a] + after[s] * k)

    best: dict[tuple[int, int], tuple[int, int]] = {(0, 0): (0, 0)}
    for s in range(1, num_stages + 1):
        for end in range(s, num_layers - (num_stages - s) + 1):
            best[s, end] = min(
                (max(best[s - 1, a][0], cost(s - 1, a, end)), a)
                for a in range(s - 1, end)
                if (s - 1, a) in best
            )
    bounds = [num_layers]
    for s in range(num_stages, 0, -1):
        bounds.append(best[s, bounds[-1]][1])
    return Partition(boundaries=tuple(reversed(bounds)))


def _balanced_for(config: MemoryConfig, pp: int) -> Partition:
    """The memory-balanced partition for `pp` stages, from the per-layer sums.

    `layer_memory`'s states are four equal fp32 copies (weights, gradients, AdamW's two), so a
    quarter of them are the gradients; the weight copies live all step, like the states.
    """
    schedule = make_schedule(
        config.schedule.schedule, num_ranks=pp, micro_batches=config.schedule.micro_batches
    )
    rows = [stage_actions(schedule, s) for s in range(pp)]
    states, kept, copies = layer_memory(config)
    grads = [state // 4 for state in states]
    return memory_balanced(
        [state - grad + copy for state, grad, copy in zip(states, grads, copies, strict=True)],
        kept,
        [in_flight(row) for row in rows],
        grads=grads,
        after=[held_with_gradients(row) for row in rows],
    )


def _layout_flags(partition: Partition) -> str:
    return "boundaries:" + ",".join(map(str, partition.boundaries))


def _more_stages(config: MemoryConfig, device_memory: int) -> Suggestion | None:
    """The fewest pipeline stages whose memory-balanced layout the estimator says fits, else
    the size with the lowest estimated peak (how far more stages get); None if none is left.

    Every size is estimated in increasing order. The per-layer sums `memory_balanced` weighs
    leave out transients but also overcount (gpt-tiny's 3 stages under GPipe sum to more than
    their estimate), so they are no lower bound: skipping on them passed over the smallest size
    that fits. Only `states_floor`, a true lower bound, skips a size unestimated. Stages built
    alike share one traced replay, so llama-70b's scan at pp 8 takes about 6 s.
    """
    best: MemoryReport | None = None
    for pp in range(config.parallel.pp + 1, len(resolve(config).specs) + 1):
        candidate = replace_flat(config, pp=pp, partition=_layout_flags(_balanced_for(config, pp)))
        if states_floor(candidate) > device_memory:
            continue
        report = estimate_memory(candidate)
        if best is None or report.peak < best.peak:
            best = report
        if report.peak <= device_memory:
            break
    if best is None:
        return None
    pp = best.config.parallel.pp
    devices = "GPUs" if config.device == "cuda" else "ranks"
    note = f"{pp} {devices} per pipeline instead of {config.parallel.pp}"
    change = f"--pp {pp} --partition {_layout_flags(best.partition)}"
    return Suggestion(change=change, report=best, note=note)


def states_floor(config: MemoryConfig) -> int:
    """The largest rank's weights, gradients and optimizer states, as `estimate_memory`
    counts them.

    A rank's estimated peak is its weights and optimizer states plus its step's peak, and the
    step ends with every gradient allocated (the replay's final live bytes hold them, and the
    optimizer steps on them), so the step's peak is at least the gradients. A layout whose
    floor exceeds the device cannot fit: a true lower bound, with no replay.
    """
    layout = resolve(config)
    alone = [
        stage_memory(config, layout, s, kept=0, weight_copies=0, step_peak=0)
        for s in range(layout.partition.num_stages)
    ]
    floors = [stage.peak + stage.gradients for stage in alone]
    return max(
        sum(floors[s] for s in layout.schedule.stages_of(r)) for r in range(config.parallel.pp)
    )


_Candidate = tuple[str, MemoryConfig, str]


def _recompute(config: MemoryConfig, stages: Sequence[int]) -> list[_Candidate]:
    if config.engine.recompute == "full" and config.engine.recompute_stages is None:
        return []
    found = [
        ("--recompute full", replace_flat(config, recompute="full", recompute_stages=None), "")
    ]
    if len(stages) < config.num_stages:
        only = replace_flat(config, recompute="full", recompute_stages=tuple(stages))
        note = "meshpipe train takes the same --recompute-stages"
        found.append(
            (f"--recompute full --recompute-stages {','.join(map(str, stages))}", only, note)
        )
    return found


def _same_devices(config: MemoryConfig) -> list[_Candidate]:
    """Layouts on the same devices and the same global and micro-batch sizes: a higher ZeRO
    level, or half the replicas traded for twice the pipeline stages or the tensor-parallel
    width (with twice the micro-batches per replica), or under tp the sequence split too
    (`--sequence-parallel`). A user with 64 GPUs asks how to place
    the model on them, not on more; one the configuration refuses (tp not dividing the heads,
    more stages than layers) is no candidate."""
    parallel, micro_batches = config.parallel, config.schedule.micro_batches
    changes: list[tuple[str, dict[str, object], str]] = [
        (f"--zero {level}", {"zero": level}, _ZERO_NOTES.get(level, ""))
        for level in ZERO_LEVELS
        if level > config.engine.zero and parallel.dp > 1
    ]
    if parallel.tp > 1 and not config.engine.sequence_parallel:
        changes.append(("--sequence-parallel", {"sequence_parallel": True}, ""))
    if parallel.dp > 1 and config.engine.zero_reshard != "micro-batch":
        zero = "" if config.engine.zero == 3 else "--zero 3 "
        per_micro_batch = {"zero": 3, "zero_reshard": "micro-batch"}
        changes.append((f"{zero}--zero-reshard micro-batch", per_micro_batch, _RESHARD_NOTE))
    if parallel.dp % 2 == 0:
        fewer = {"dp": parallel.dp // 2, "micro_batches": 2 * micro_batches}
        batches = f"--dp {parallel.dp // 2} --micro-batches {2 * micro_batches}"
        if config.schedule.stages_per_rank == 1 and 2 * parallel.pp <= len(resolve(config).specs):
            flags = _layout_flags(_balanced_for(config, 2 * parallel.pp))
            deeper = {"pp": 2 * parallel.pp, "partition": flags, **fewer}
            changes.append((f"--pp {2 * parallel.pp} {batches} --partition {flags}", deeper, ""))
        changes.append((f"--tp {2 * parallel.tp} {batches}", {"tp": 2 * parallel.tp, **fewer}, ""))
    found = []
    for change, fields, note in changes:
        try:
            candidate = replace_flat(config, **fields)
        except ValueError:
            continue
        found.append((change, candidate, note or _same_count(config)))
    return found


_ZERO_NOTES = {3: "meshpipe train runs ZeRO-3 with --optimizer-impl per_tensor"}
_RESHARD_NOTE = (
    "a gather per forward and backward and a reduce-scatter per micro-batch; "
    "meshpipe train runs ZeRO-3 with --optimizer-impl per_tensor"
)


def _same_count(config: MemoryConfig) -> str:
    parallel = config.parallel
    devices = "GPUs" if config.device == "cuda" else "ranks"
    return f"the same {parallel.pp * parallel.dp * parallel.tp} {devices}"


def _candidates(
    config: MemoryConfig, report: MemoryReport, over: Sequence[int]
) -> list[_Candidate]:
    found = _recompute(config, sorted(s.stage for s in report.stages if s.rank in over))
    found += _same_devices(config)
    if config.schedule.stages_per_rank == 1 and config.parallel.pp > 1:
        partition = _balanced_for(config, config.parallel.pp)
        if partition != report.partition:
            flags = _layout_flags(partition)
            found.append(
                (
                    f"--partition {flags}",
                    replace_flat(config, partition=flags),
                    "boundaries balancing per-layer memory sums",
                )
            )
    if config.micro_batch_size % 2 == 0:
        mbs, m = config.micro_batch_size // 2, 2 * config.schedule.micro_batches
        smaller = replace_flat(config, micro_batches=m)  # the same global batch
        found.append(
            (f"--micro-batch-size {mbs} --micro-batches {m}", smaller, "same global batch")
        )
    return found


_LIGHT_SCHEDULES = ("1f1b", "zb_h1")
"""Schedules whose first stage holds at most P micro-batches in flight (1F1B's bound); ZB-H1
also keeps W inputs on the later stages, in exchange for a smaller bubble."""


def _lighter_schedules(config: MemoryConfig, report: MemoryReport) -> list[Suggestion]:
    """The light schedules whose estimated peak is below the layout's (same stages, no extra
    compute: the first thing to try when GPipe, ZB-H2 or zb_drain does not fit)."""
    if config.schedule.stages_per_rank != 1:
        return []
    found = []
    for name in _LIGHT_SCHEDULES:
        if name == config.schedule.schedule:
            continue
        try:
            candidate = replace_flat(config, schedule=name)
        except ValueError:  # a schedule the layout refuses (zb_h1 under per-micro-batch reshard)
            continue
        lighter = estimate_memory(candidate)
        if lighter.peak < report.peak:
            before, after = report.stages[0].in_flight, lighter.stages[0].in_flight
            note = f"stage 0 holds {after} micro-batches in flight instead of {before}"
            found.append(Suggestion(change=f"--schedule {name}", report=lighter, note=note))
    return found


def suggest(config: MemoryConfig, report: MemoryReport, device_memory: int) -> list[Suggestion]:
    """Alternatives for a layout whose peak exceeds `device_memory` on some rank, estimated.

    Only alternatives whose estimated peak is below the layout's are offered: a heuristic
    candidate (the memory-balanced boundaries come from per-layer sums, not the replay) can
    come out worse, and a suggestion that raises the peak is no suggestion.
    """
    over = report.ranks_over(device_memory)
    if not over:
        return []
    found = _lighter_schedules(config, report) + [
        Suggestion(change=change, report=estimate_memory(candidate), note=note)
        for change, candidate, note in _candidates(config, report, over)
    ]
    if config.schedule.stages_per_rank == 1:
        full = replace_flat(config, recompute="full", recompute_stages=None)
        variants = [("", config), ("--recompute full ", full)]
        for prefix, variant in variants[: 1 if full == config else 2]:
            more = _more_stages(variant, device_memory)
            if more is not None:
                found.append(replace(more, change=prefix + more.change))
    return [s for s in found if s.report.peak < report.peak]
