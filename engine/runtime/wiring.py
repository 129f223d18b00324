"""How a `PipelineEngine`'s parts are built from its layout: this rank's stages, the exchange
and the step reports over the pipeline's groups, the replicas' meetings or parameter server,
the tied weights' groups, the gradients' checks and the optimizer (plain, ZeRO-1/2's flat
buffers, or over FSDP's shards).

Each part is built once, in the order the engine calls them: every rank makes the process
groups (`new_group` is collective over the world) in the same order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from engine.comm.channels import PipelineChannels
from engine.comm.mesh import Mesh
from engine.comm.p2p import StageExchange
from engine.comm.step_report import StepReports
from engine.comm.ties import TiedWeights, new_tie_groups, share_local_ties, tied_parameters
from engine.config import EngineOptions, OptimizerSpec, ReplicaSync, check_zero_optimizer
from engine.parallel import FullyShardedLayers, ParameterServer, ReplicaMeetings, ShardedOptimizer
from engine.runtime.gradients import StepGradients
from engine.runtime.micro_batches import LossFn
from engine.runtime.optim import build_from_spec, build_sharded
from engine.runtime.precision import compute_dtype
from engine.runtime.sharded_stages import fully_shard_stages
from engine.runtime.stage import PipelineStage
from engine.schedule.schedule import Schedule
from models import LayerSpec
from partitioners import Partition

__all__ = [
    "OptimizerFactory",
    "build_exchange",
    "build_gradients",
    "build_meetings",
    "build_optimizer",
    "build_param_server",
    "build_reports",
    "build_stages",
    "build_ties",
    "check_layout",
]

OptimizerFactory = Callable[[nn.Module], torch.optim.Optimizer]


def build_stages(
    specs: Sequence[LayerSpec],
    partition: Partition,
    *,
    schedule: Schedule,
    mesh: Mesh,
    options: EngineOptions,
    seed: int,
    loss_fn: LossFn,
    split: bool,
) -> tuple[dict[int, PipelineStage], FullyShardedLayers | None]:
    """This rank's stages, built on its device, and under ZeRO-3 their layers fully sharded
    over the stage's replicas. Stages on one rank share their tied weights; with `split`
    (the rank's row splits a backward) every stage records what its W needs."""
    stages = {
        s: PipelineStage(
            specs,
            stage=s,
            layers=partition.layers_of(s),
            num_stages=partition.num_stages,
            seed=seed,
            device=mesh.device,
            loss_fn=loss_fn,
            precision=options.precision,
            recompute=options.recompute_of(s),
            compile=options.compile,
            tp_mesh=mesh.tp_mesh,
            sequence_parallel=options.sequence_parallel,
        )
        for s in schedule.stages_of(mesh.pp_rank)
    }
    if split:
        for stage in stages.values():
            stage.enable_split_backward()
    share_local_ties(specs, [stage.module for stage in stages.values()])
    if options.zero != 3:
        return stages, None
    dp_mesh = mesh.device_mesh["dp"] if mesh.device_mesh is not None else None
    fsdp = fully_shard_stages(
        list(stages.values()),
        dp_mesh,
        options.precision,
        pp_rank=mesh.pp_rank,
        reshard=[options.reshard_of(s) for s in stages],
    )
    return stages, fsdp


def _rank_of_stage(schedule: Schedule, mesh: Mesh, stage: int) -> int:
    """The global rank holding `stage` in this rank's replica and tp column."""
    return mesh.global_rank(pp_rank=schedule.rank_of(stage))


def build_exchange(
    channels: PipelineChannels, schedule: Schedule, mesh: Mesh, *, timeout_s: float
) -> StageExchange:
    return StageExchange(
        groups=channels.edges,
        global_rank_of_stage={
            s: _rank_of_stage(schedule, mesh, s) for s in range(schedule.num_stages)
        },
        device=mesh.device,
        timeout_s=timeout_s,
        wire_device=mesh.wire_device,
    )


def build_reports(
    channels: PipelineChannels, schedule: Schedule, mesh: Mesh, *, timeout_s: float
) -> StepReports:
    return StepReports(
        group=channels.reports,
        ranks=[mesh.global_rank(pp_rank=r) for r in range(mesh.pp)],
        me=mesh.rank,
        last=_rank_of_stage(schedule, mesh, schedule.num_stages - 1),
        device=mesh.wire_device,
        timeout_s=timeout_s,
    )


def build_meetings(
    module: nn.Module, mesh: Mesh, sync: ReplicaSync, options: EngineOptions
) -> ReplicaMeetings | None:
    """Semi-synchronous replicas (local SGD, DiLoCo): their meetings (None every step)."""
    if not sync.periodic or mesh.dp == 1:
        return None
    if options.zero:
        raise ValueError(
            f"dp_sync={sync.dp_sync!r} with zero={options.zero}: ZeRO shards over "
            "replicas that hold the same weights every step; use zero=0 or every-step"
        )
    return ReplicaMeetings(list(module.parameters()), mesh.dp_group, sync, dp=mesh.dp)


def build_param_server(
    module: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    mesh: Mesh,
    sync: ReplicaSync,
    *,
    options: EngineOptions,
    timeout_s: float,
) -> ParameterServer | None:
    """Pair groups (server, replica) for every stage's dp group, made by every rank in
    one order; this rank's side of its own stage's server."""
    if sync.dp_sync != "parameter-server" or mesh.dp == 1 or optimizer is None:
        return None
    if options.zero:
        raise ValueError(
            f"dp_sync='parameter-server' with zero={options.zero}: the server holds "
            "each stage's whole optimizer state; use zero=0 or every-step"
        )
    links: dict[int, tuple[dist.ProcessGroup, int]] = {}
    for pp_rank in range(mesh.pp):
        for tp_rank in range(mesh.tp):
            ranks = [
                mesh.global_rank(pp_rank=pp_rank, dp_rank=d, tp_rank=tp_rank)
                for d in range(mesh.dp)
            ]
            for d in range(1, mesh.dp):
                group = dist.new_group([ranks[0], ranks[d]], timeout=timedelta(days=1))
                if mesh.rank == ranks[0]:
                    links[d] = (group, ranks[d])
                elif mesh.rank == ranks[d]:
                    links[0] = (group, ranks[0])
    return ParameterServer(
        list(module.parameters()),
        optimizer,
        dp_rank=mesh.dp_rank,
        dp=mesh.dp,
        max_staleness=sync.max_staleness,
        links=links,
        timeout_s=timeout_s,
    )


def build_ties(
    stages: dict[int, PipelineStage],
    specs: Sequence[LayerSpec],
    partition: Partition,
    *,
    schedule: Schedule,
    mesh: Mesh,
    timeout_s: float,
) -> TiedWeights:
    """This rank's tied weights and, across ranks, the groups that sum their gradients."""
    tied: dict[str, nn.Parameter] = {}
    for stage in stages.values():
        tied.update(tied_parameters(stage.module, specs, stage.layers))
    groups: dict[str, dist.ProcessGroup | None] = {}
    if mesh.world_size > 1:
        all_stages = range(partition.num_stages)
        groups = new_tie_groups(
            specs,
            [partition.layers_of(s) for s in all_stages],
            [
                [
                    mesh.global_rank(pp_rank=schedule.rank_of(s), dp_rank=d, tp_rank=t)
                    for s in all_stages
                ]
                for d, t in mesh.columns()
            ],
            timeout=timedelta(seconds=timeout_s),
        )
    return TiedWeights(tied, groups, timeout_s=timeout_s)


def build_gradients(
    module: nn.Module,
    specs: Sequence[LayerSpec],
    mesh: Mesh,
    *,
    options: EngineOptions,
    sharded: ShardedOptimizer | None,
    fsdp: bool,
) -> StepGradients:
    """Norms, clipping and the skip verdict over this rank's gradients: ZeRO-1/2's
    buffers, ZeRO-3's shards (over dp, and tp), or the parameters' own `.grad`."""
    return StepGradients(
        module,
        specs,
        group=mesh.pp_group if mesh.pp > 1 else None,
        clip_grad_norm=options.clip_grad_norm,
        sharded=sharded,
        dp_group=mesh.dp_group if fsdp else None,
        tp_group=mesh.tp_group if fsdp and mesh.tp > 1 else None,
    )


def build_optimizer(
    optimizer: OptimizerFactory | OptimizerSpec | None,
    module: nn.Module,
    mesh: Mesh,
    options: EngineOptions,
) -> tuple[torch.optim.Optimizer | None, ShardedOptimizer | None]:
    """The optimizer, and under ZeRO-1/2 the flat buffers and sharded masters it steps."""
    if optimizer is None:
        return None, None
    zero = options.zero
    if isinstance(optimizer, OptimizerSpec) and zero in (1, 2):
        sharded = build_sharded(
            optimizer,
            module,
            level=zero,
            dtype=compute_dtype(options.precision),
            group=mesh.dp_group,
            dp=mesh.dp,
            dp_rank=mesh.dp_rank,
            tp_group=mesh.tp_group if mesh.tp > 1 else None,
        )
        return sharded.optimizer, sharded
    if isinstance(optimizer, OptimizerSpec):
        check_zero_optimizer(zero, optimizer.impl)
        return build_from_spec(optimizer, module), None  # on FSDP's shards under ZeRO-3
    if zero:
        raise ValueError(
            f"zero={zero} shards the optimizer's state over flat buffers it builds itself, "
            "so it needs an OptimizerSpec, not an optimizer factory: pass "
            "optimizer=OptimizerSpec(...), or zero=0 with the factory"
        )
    return optimizer(module), None


def check_layout(
    specs: Sequence[LayerSpec],
    mesh: Mesh,
    partition: Partition,
    micro_batches: int,
    stages_per_rank: int,
    options: EngineOptions,
) -> None:
    """A layout the engine cannot run, refused by name before any group is made."""
    if options.sequence_parallel and mesh.tp == 1:
        raise ValueError(
            "sequence_parallel=True splits the sequence over the tensor-parallel ranks of each "
            "stage, but the mesh has tp=1: use a mesh with tp > 1, or sequence_parallel=False"
        )
    if partition.num_layers != len(specs):
        raise ValueError(
            f"the partition covers {partition.num_layers} layers but the model has {len(specs)}: "
            "partition this model's layer list"
        )
    if partition.num_stages != mesh.pp * stages_per_rank:
        raise ValueError(
            f"the partition has {partition.num_stages} stages but the mesh has pp={mesh.pp} "
            f"pipeline ranks × {stages_per_rank} stages per rank: partition into "
            f"{mesh.pp * stages_per_rank} stages"
        )
    if micro_batches < 1:
        raise ValueError(f"micro_batches={micro_batches} must be at least 1")
