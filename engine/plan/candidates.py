"""The layouts the planner weighs: every mesh, schedule, micro-batching and ZeRO level the
engine accepts for a model on a number of devices.

The engine's own refusals (`engine.config.check_layout`) are applied here as rules, so no
candidate is one `meshpipe train` would refuse: tensor parallelism within a node, dividing the
model's heads and widths, and with a sequence length it divides when stages exchange shards;
ZeRO only with replicas (every level composes with tensor parallelism); ZeRO-3 resharded per
micro-batch not with a split backward (zb_* and the V schedules); at most one stage per layer;
interleaved 1F1B with a multiple of the pipeline's ranks as micro-batches; DualPipeV with at
least as many micro-batches as stages; no ZeRO-3 where the model ties its embedding to its head
and one rank holds both (a single stage, or the V placement's rank 0): FSDP2 shards each layer
on its own (`engine.parallel.fsdp.check_unshared`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from engine.config import ZERO_LEVELS
from engine.config.parallel import ParallelConfig, check_tensor_parallel_shape
from engine.schedule import SCHEDULES, V_SCHEDULES, VIRTUAL_SCHEDULES
from models import get_config

__all__ = ["Candidate", "candidates", "divisors", "meshes"]

SPLIT_SCHEDULES = frozenset({"zb_h1", "zb_h2", "zb_drain", *V_SCHEDULES})
"""Schedules whose backward is split into I and W (every V schedule splits some)."""

STAGES_PER_RANK = (2, 4)
"""v tried with the virtual schedules."""


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True, kw_only=True)
class Candidate:
    """One layout: mesh, schedule, micro-batching, ZeRO level and stages recomputed."""

    mesh: ParallelConfig
    """pp × dp × tp (the default rank order)."""
    schedule: str
    stages_per_rank: int
    micro_batches: int
    micro_batch_size: int
    zero: int = 0
    zero_reshard: str = "step"
    recompute: tuple[int, ...] = ()
    """Stages that recompute their forward in the backward."""
    recompute_every: int = 0
    """0: those stages recompute whole (`--recompute full`); N: in runs of N layers, each
    run's input kept (`--recompute every:N`), so one run's activations are regenerated at a
    time instead of the stage's."""

    @property
    def recompute_policy(self) -> str:
        """The `--recompute` value of the stages recomputed."""
        if not self.recompute:
            return "none"
        return f"every:{self.recompute_every}" if self.recompute_every else "full"

    @property
    def num_stages(self) -> int:
        return self.mesh.pp * self.stages_per_rank

    @property
    def split(self) -> bool:
        return self.schedule in SPLIT_SCHEDULES

    def describe(self) -> str:
        m = self.mesh
        v = f" v{self.stages_per_rank}" if self.stages_per_rank > 1 else ""
        zero = f" zero{self.zero}" if self.zero else ""
        if self.zero == 3 and self.zero_reshard != "step":
            zero += "/mb"
        every = f" every:{self.recompute_every}" if self.recompute_every else ""
        if not self.recompute:
            recompute = ""
        elif len(self.recompute) == self.num_stages:
            recompute = " recompute" + every
        else:
            recompute = " recompute" + every + " " + ",".join(map(str, self.recompute))
        return (
            f"pp{m.pp} dp{m.dp} tp{m.tp} {self.schedule}{v} mbs{self.micro_batch_size}"
            f"×{self.micro_batches}{zero}{recompute}"
        )


def meshes(
    model: str, devices: int, *, num_layers: int, seq_len: int, gpus_per_node: int
) -> Iterator[ParallelConfig]:
    """pp × dp × tp = devices, tp within a node and dividing the model's shapes."""
    config = get_config(model)
    for tp in divisors(devices):
        if tp > gpus_per_node:
            continue
        try:
            check_tensor_parallel_shape(model, config, tp)
        except ValueError:
            continue
        for pp in divisors(devices // tp):
            if pp > num_layers or (tp > 1 and pp > 1 and seq_len % tp):
                continue
            yield ParallelConfig(pp=pp, dp=devices // (tp * pp), tp=tp)


def _schedules(pp: int, num_layers: int, names: Sequence[str]) -> Iterator[tuple[str, int]]:
    """(schedule, stages per rank): one schedule for a single stage (they all run it alike);
    the V schedules fold two stages per rank."""
    if pp == 1:
        yield "1f1b", 1
        return
    for name in names:
        if name in V_SCHEDULES:
            if 2 * pp <= num_layers:
                yield name, 2
            continue
        if name not in VIRTUAL_SCHEDULES:
            yield name, 1
            continue
        for v in STAGES_PER_RANK:
            if pp * v <= num_layers:
                yield name, v


def _zero_levels(mesh: ParallelConfig, split: bool) -> Iterator[tuple[int, str]]:
    """The ZeRO levels the engine runs on `mesh`: none without replicas; with tp each shards
    the tp ranks' slices over their replicas (ZeRO-1/2's flat buffers of local shards, FSDP2
    over the (dp, tp) mesh)."""
    yield 0, "step"
    if mesh.dp == 1:
        return
    for level in ZERO_LEVELS[1:]:
        yield level, "step"
    if not split:
        yield 3, "micro-batch"


def candidates(
    mesh: ParallelConfig,
    *,
    global_batch: int,
    num_layers: int,
    micro_batch_sizes: Sequence[int],
    schedules: Sequence[str] = tuple(SCHEDULES),
    tied: bool = False,
) -> Iterator[Candidate]:
    """Every layout of one mesh (no recompute yet: the memory check adds it where needed);
    `tied`: the model's embedding and head share a weight."""
    if global_batch % mesh.dp:
        return
    for mbs in micro_batch_sizes:
        if (global_batch // mesh.dp) % mbs:
            continue
        m = global_batch // (mesh.dp * mbs)
        for name, v in _schedules(mesh.pp, num_layers, schedules):
            if (name == "interleaved_1f1b" and m % mesh.pp) or (
                name == "dualpipe_v" and m < 2 * mesh.pp
            ):
                continue
            for zero, reshard in _zero_levels(mesh, name in SPLIT_SCHEDULES):
                if zero == 3 and tied and (mesh.pp == 1 or name in V_SCHEDULES):
                    continue
                yield Candidate(
                    mesh=mesh,
                    schedule=name,
                    stages_per_rank=v,
                    micro_batches=m,
                    micro_batch_size=mbs,
                    zero=zero,
                    zero_reshard=reshard,
                )
