"""The FLOPs report of one training step (what DeepSpeed's flops_profiler prints): FLOPs
counted per layer and stage, divided by the step's measured time.

Counted, not traced: a layer's forward FLOPs are its model's closed form (`forward_flops`: 2
per weight per token, plus causal attention). Training a micro-batch costs 3 forwards (the
backward computes input and weight gradients, 2 forwards' worth) plus one more forward of
every layer its stage recomputes (`EngineOptions.recompute_of`, `recompute_groups`), so the
recomputation is counted exactly, never estimated. Each tp rank of a stage does 1/tp of the
stage's FLOPs; every dp replica does all of its own.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from engine.config import recompute_groups
from engine.training.config import TrainConfig
from models import LayerSpec
from partitioners import Partition

__all__ = [
    "FlopsReport",
    "LayerFlops",
    "StageFlops",
    "flops_report",
    "format_flops_report",
    "recomputed_share",
    "stage_flops",
]

BACKWARD_FORWARDS = 2
"""A backward costs two forwards: the input gradient and the weight gradient GEMMs."""


@dataclass(frozen=True, kw_only=True)
class LayerFlops:
    """One layer's share of a micro-batch."""

    index: int
    """Global layer index."""
    name: str
    parameters: int
    forward_flops: int
    """Forward FLOPs of one micro-batch."""
    recomputed: bool
    """Whether its stage runs its forward again in the backward."""


@dataclass(frozen=True, kw_only=True)
class StageFlops:
    """One stage's layers and what a step costs it on one replica."""

    stage: int
    rank: int
    """The pipeline rank holding the stage."""
    layers: tuple[LayerFlops, ...]
    micro_batches: int

    @property
    def parameters(self) -> int:
        return sum(layer.parameters for layer in self.layers)

    @property
    def forward_flops(self) -> int:
        """Forward FLOPs of one micro-batch."""
        return sum(layer.forward_flops for layer in self.layers)

    @property
    def recomputed_flops(self) -> int:
        """FLOPs of the forwards run again per micro-batch."""
        return sum(layer.forward_flops for layer in self.layers if layer.recomputed)

    @property
    def step_flops(self) -> int:
        """Training FLOPs of a step: forward, backward and recomputation of every micro-batch."""
        per_micro_batch = (1 + BACKWARD_FORWARDS) * self.forward_flops + self.recomputed_flops
        return self.micro_batches * per_micro_batch


def stage_flops(
    specs: Sequence[LayerSpec],
    partition: Partition,
    placement: Sequence[int],
    *,
    micro_batch_size: int,
    seq_len: int,
    micro_batches: int,
    recompute_of: Callable[[int], str],
) -> tuple[StageFlops, ...]:
    """Every stage's layers with their FLOPs for (micro_batch_size, seq_len) micro-batches;
    `placement[s]` is the pipeline rank of stage s, `recompute_of(s)` its recompute policy."""
    stages = []
    for s in range(partition.num_stages):
        indices = partition.layers_of(s)
        again = {
            indices[i]
            for run, recomputed in recompute_groups(len(indices), recompute_of(s))
            if recomputed
            for i in run
        }
        layers = tuple(
            LayerFlops(
                index=i,
                name=specs[i].name,
                parameters=specs[i].num_parameters(),
                forward_flops=specs[i].forward_flops(micro_batch_size, seq_len),
                recomputed=i in again,
            )
            for i in indices
        )
        stages.append(
            StageFlops(stage=s, rank=placement[s], layers=layers, micro_batches=micro_batches)
        )
    return tuple(stages)


def recomputed_share(stages: Sequence[StageFlops]) -> float:
    """The share of the forward FLOPs run again in the backward (DeepSpeed's
    recompute_fwd_factor): 0 without recomputation, 1 when every layer is recomputed."""
    forward = sum(stage.forward_flops for stage in stages)
    return sum(stage.recomputed_flops for stage in stages) / forward if forward else 0.0


@dataclass(frozen=True, kw_only=True)
class FlopsReport:
    """The FLOPs of one step on the pp × dp × tp mesh and the rate its measured time gives."""

    step: int
    """The step, counted from 1."""
    step_seconds: float
    """Rank 0's wall time of the step."""
    stages: tuple[StageFlops, ...]
    pp: int
    dp: int
    tp: int
    micro_batch_size: int
    seq_len: int
    peak_tflops: float = 0.0
    """One accelerator's peak TFLOP/s; 0 when unknown (no MFU)."""

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.tp

    @property
    def step_flops(self) -> int:
        """Training FLOPs of the step over the whole mesh (every dp replica)."""
        return self.dp * sum(stage.step_flops for stage in self.stages)

    def rank_tflops(self, rank: int) -> float:
        """TFLOP/s each of pipeline rank `rank`'s dp × tp ranks achieved: its stages' FLOPs
        over tp, over the step time."""
        flops = sum(stage.step_flops for stage in self.stages if stage.rank == rank)
        return flops / self.tp / self.step_seconds / 1e12

    @property
    def mesh_tflops(self) -> float:
        return self.step_flops / self.step_seconds / 1e12

    @property
    def mfu(self) -> float | None:
        """Model FLOPs utilisation of the mesh, or None without a peak."""
        if self.peak_tflops <= 0:
            return None
        return self.mesh_tflops / (self.peak_tflops * self.world_size)


def flops_report(
    config: TrainConfig,
    specs: Sequence[LayerSpec],
    partition: Partition,
    placement: Sequence[int],
    *,
    step: int,
    seconds: float,
) -> FlopsReport:
    """The report of a run's step `step` (counted from 1) that took `seconds`."""
    parallel, schedule = config.parallel, config.schedule
    size = config.batch.micro_batch_size(parallel.dp, schedule.micro_batches)
    stages = stage_flops(
        specs,
        partition,
        placement,
        micro_batch_size=size,
        seq_len=config.batch.seq_len,
        micro_batches=schedule.micro_batches,
        recompute_of=config.engine.recompute_of,
    )
    return FlopsReport(
        step=step,
        step_seconds=seconds,
        stages=stages,
        pp=parallel.pp,
        dp=parallel.dp,
        tp=parallel.tp,
        micro_batch_size=size,
        seq_len=config.batch.seq_len,
        peak_tflops=config.monitor.device_peak_tflops,
    )


def _row(cells: Sequence[object]) -> str:
    """Columns right-aligned, but the layers' (third) left-aligned: it names layers too."""
    widths = (6, 5, -16, 12, 18, 18, 20)
    return " ".join(
        f"{c!s:<{-w}}" if w < 0 else f"{c!s:>{w}}" for c, w in zip(cells, widths, strict=False)
    ).rstrip()


def _stage_lines(stage: StageFlops) -> list[str]:
    first, last = stage.layers[0].index, stage.layers[-1].index
    lines = [
        _row(
            (
                stage.stage,
                stage.rank,
                f"{first}-{last}",
                f"{stage.parameters:,}",
                f"{stage.forward_flops:,}",
                f"{stage.recomputed_flops:,}",
                f"{stage.step_flops:,}",
            )
        )
    ]
    for layer in stage.layers:
        again = f"{layer.forward_flops:,}" if layer.recomputed else "0"
        cells = ("", "", f"  {layer.index} {layer.name}", f"{layer.parameters:,}")
        lines.append(_row((*cells, f"{layer.forward_flops:,}", again)))
    return lines


def _rate_lines(report: FlopsReport) -> list[str]:
    peak = report.peak_tflops
    lines = []
    for rank in range(report.pp):
        rate = report.rank_tflops(rank)
        share = f", MFU {rate / peak:.1%}" if peak > 0 else ""
        each = f"  pipeline rank {rank} (each of its dp x tp ranks)"
        lines.append(f"{each}: {rate:.4g} TFLOP/s{share}")
    mfu = report.mfu
    lines.append(
        f"  whole mesh ({report.world_size} ranks): {report.mesh_tflops:.4g} TFLOP/s"
        + (f", MFU {mfu:.1%} of {peak:g} TFLOP/s per rank" if mfu is not None else "")
    )
    if mfu is None:
        lines.append(
            "  MFU: give --device-peak-tflops X, one accelerator's dense peak at the run's "
            "precision (989 for an H100 SXM in bf16)"
        )
    return lines


def format_flops_report(report: FlopsReport) -> str:
    """The report as text: a row per stage, then its layers, the totals and the rates."""
    stages = report.stages
    header = (
        f"FLOPs report of step {report.step}: {stages[0].micro_batches} micro-batches of "
        f"{report.micro_batch_size} x {report.seq_len} tokens per replica, pp {report.pp} x "
        f"dp {report.dp} x tp {report.tp}, step time {report.step_seconds:.4g} s (rank 0)"
    )
    names = ("stage", "rank", "layers", "parameters", "fwd FLOPs/micro", "recomputed/micro")
    lines = [header, _row((*names, "train FLOPs/step"))]
    for stage in stages:
        lines.extend(_stage_lines(stage))
    total = (
        "total",
        "",
        "",
        f"{sum(s.parameters for s in stages):,}",
        f"{sum(s.forward_flops for s in stages):,}",
        f"{sum(s.recomputed_flops for s in stages):,}",
        f"{sum(s.step_flops for s in stages):,}",
    )
    lines.append(_row(total))
    lines.append(
        f"training FLOPs of the step over the mesh (x dp {report.dp}): {report.step_flops:,} "
        "(3 forwards per micro-batch, plus each recomputed layer's forward once more)"
    )
    lines.extend(_rate_lines(report))
    return "\n".join(lines)
