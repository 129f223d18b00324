"""PipelineEngine: one training or evaluation step of a pipeline replica on the mesh.

The stage computes, the runtime interprets the schedule, the exchange moves tensors, the
reducers sum gradients; the engine wires them together for one step (each part built by
`engine.runtime.wiring`, what follows the schedule run by `engine.runtime.step_end`) and
reports what it saw (loss on every rank, busy time, measured bubble, in-flight peak).
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from engine.comm.channels import new_pipeline_channels
from engine.comm.collective import naming_failures
from engine.comm.grad_sync import BucketedAllReduce
from engine.comm.mesh import Mesh
from engine.comm.replica_group import ReplicaGroup
from engine.config import EngineOptions, OptimizerSpec, ReplicaSync
from engine.parallel import SequenceShards, align_gradients
from engine.runtime.host_memory import keep_freed_host_memory
from engine.runtime.interpreter import ActionTiming, execute
from engine.runtime.micro_batches import LossFn
from engine.runtime.precision import LossScaler, step_casts
from engine.runtime.step import StepContext, StepRun
from engine.runtime.step_clock import step_clock
from engine.runtime.step_end import StepEnd
from engine.runtime.step_stats import StepStats, published_figures
from engine.runtime.wiring import (
    OptimizerFactory,
    build_exchange,
    build_gradients,
    build_meetings,
    build_optimizer,
    build_param_server,
    build_reports,
    build_stages,
    build_ties,
    check_layout,
)
from engine.schedule.actions import split_units
from engine.schedule.delivery import released_at
from engine.schedule.resolve import lowered_schedules
from engine.schedule.schedule import Schedule
from models import LayerSpec, lm_loss
from partitioners import Partition

__all__ = ["OptimizerFactory", "PipelineEngine"]


class PipelineEngine:
    """Runs this rank's stage of a partitioned layer list under a pipeline schedule."""

    def __init__(
        self,
        specs: Sequence[LayerSpec],
        mesh: Mesh,
        *,
        partition: Partition,
        micro_batches: int,
        schedule: str | Schedule = "1f1b",
        stages_per_rank: int = 1,
        seed: int = 0,
        optimizer: OptimizerFactory | OptimizerSpec | None = None,
        loss_fn: LossFn = lm_loss,
        timeout_s: float = 300.0,
        options: EngineOptions | None = None,
        replica_sync: ReplicaSync | None = None,
        replicas: ReplicaGroup | None = None,
    ) -> None:
        self.options = options or EngineOptions()
        self.replicas = replicas
        """--fault-tolerant: this replica's torchft group, over which the dp exchange runs
        (the mesh is then this replica's alone, dp = 1)."""
        self.replica_sync = replica_sync or ReplicaSync()
        """How this stage's replicas stay together: every step, or every H steps."""
        check_layout(specs, mesh, partition, micro_batches, stages_per_rank, self.options)
        self.mesh, self.micro_batches, self.timeout_s = mesh, micro_batches, timeout_s
        if mesh.device.type == "cpu":
            keep_freed_host_memory()
        self.schedule, self.eval_schedule = lowered_schedules(
            schedule, num_ranks=mesh.pp, micro_batches=micro_batches, stages=stages_per_rank
        )
        self.split_units = split_units(self.schedule.rows[mesh.pp_rank])
        self.closed = False
        self._wire_pipeline(specs, partition, seed=seed, loss_fn=loss_fn)
        self._wire_replicas(specs, partition, optimizer)
        self.scaler = LossScaler.of(self.options)
        self.skipped_steps = 0
        self._end = StepEnd(
            mesh=self.mesh,
            options=self.options,
            timeout_s=timeout_s,
            dp_reduce=self._dp_reduce,
            sharded=self.sharded,
            ties=self.ties,
            gradients=self.gradients,
            optimizer=self.optimizer,
            param_server=self.param_server,
            meetings=self.meetings,
            replicas=replicas,
            replica_sync=self.replica_sync,
            scaler=self.scaler,
        )
        self._previous_figures: Callable[[], tuple[float, float]] | None = None

    def _wire_pipeline(
        self, specs: Sequence[LayerSpec], partition: Partition, *, seed: int, loss_fn: LossFn
    ) -> None:
        """This rank's stages and what they exchange over the pipeline."""
        mesh, timeout_s = self.mesh, self.timeout_s
        self.stages, self.fsdp = build_stages(
            specs,
            partition,
            schedule=self.schedule,
            mesh=mesh,
            options=self.options,
            seed=seed,
            loss_fn=loss_fn,
            split=bool(self.split_units),
        )
        """This rank's stages; `fsdp`: under ZeRO-3 their layers, each fully sharded over
        the stage's replicas."""
        self.module = nn.ModuleList(stage.module for stage in self.stages.values())
        self.channels = new_pipeline_channels(self.schedule, mesh, timeout_s=timeout_s)
        """The process groups this rank's pipeline traffic travels over (one per edge)."""
        self.exchange = build_exchange(self.channels, self.schedule, mesh, timeout_s=timeout_s)
        self._shards = (
            SequenceShards(mesh.tp_group, mesh.tp_rank, mesh.tp)
            if mesh.tp > 1 and mesh.tp_group is not None and not self.options.sequence_parallel
            else None
        )
        """Each tp rank exchanges 1/tp of every boundary tensor (None without tp, and under
        sequence parallelism, where each rank's stage output is its sequence shard already)."""
        self.reports = build_reports(self.channels, self.schedule, mesh, timeout_s=timeout_s)

    def _wire_replicas(
        self,
        specs: Sequence[LayerSpec],
        partition: Partition,
        optimizer: OptimizerFactory | OptimizerSpec | None,
    ) -> None:
        """What keeps the stages' replicas and tied weights together, and the optimizer."""
        mesh, replicas = self.mesh, self.replicas
        self._dp_reduce = BucketedAllReduce(
            list(self.module.parameters()),
            mesh.dp_group,
            reduce=replicas.all_reduce if replicas is not None else None,
        )
        self.meetings = build_meetings(self.module, mesh, self.replica_sync, self.options)
        """Semi-synchronous replicas (local SGD, DiLoCo): their meetings (None every step)."""
        self.ties = build_ties(
            self.stages,
            specs,
            partition,
            schedule=self.schedule,
            mesh=mesh,
            timeout_s=self.timeout_s,
        )
        self.optimizer, self.sharded = build_optimizer(optimizer, self.module, mesh, self.options)
        """`sharded`: ZeRO-1/2's flat buffers, sharded masters and their optimizer."""
        self.param_server = build_param_server(
            self.module,
            self.optimizer,
            mesh,
            self.replica_sync,
            options=self.options,
            timeout_s=self.timeout_s,
        )
        """--dp-sync parameter-server: this rank's side of its stage's server (else None)."""
        self.gradients = build_gradients(
            self.module, specs, mesh, options=self.options, sharded=self.sharded,
            fsdp=self.fsdp is not None,
        )  # fmt: skip

    @property
    def is_first(self) -> bool:
        return 0 in self.stages

    @property
    def is_last(self) -> bool:
        return max(self.stages) == self.schedule.num_stages - 1

    def train_step(
        self,
        inputs: torch.Tensor | None,
        targets: torch.Tensor | None,
        documents: torch.Tensor | None = None,
    ) -> StepStats:
        """Forward and backward every micro-batch, reduce gradients, step the optimizer.

        Only the first stage needs `inputs` and only the last needs `targets`; other ranks may
        pass None. With packed documents every rank passes the batch's `documents` (document
        id of each token, shape of `inputs`). The returned loss is the global batch's mean,
        on every rank.
        """
        if self.sharded is not None:
            self.sharded.begin_step()
        else:
            for param in self.module.parameters():
                param.grad = None
        if self.fsdp is not None:
            self.fsdp.begin_step()
        origin = time.perf_counter()
        timings, loss = self._run(
            self.schedule, inputs, targets, training=True, origin=origin, documents=documents
        )
        step_s = time.perf_counter() - origin
        busy = sum(t.end - t.start for t in timings if t.action.is_compute)
        end = self._end
        phases = [*end.finish_dp_reduction(origin), *end.sum_tied_weights(origin)]
        opt_start = time.perf_counter()
        norm, skipped = end.check_gradients(loss)
        self.skipped_steps += skipped
        if self.replicas is not None and not self.replicas.commit():
            skipped = True  # torchft refused the step (a peer failed): nobody steps
        figures = published_figures(
            busy,
            step_s,
            norm=norm,
            local_norms=self.gradients.local_norms,
            publish=self.reports.publish if self.mesh.pp > 1 else None,
        )
        scale = end.optimizer_step(skipped)
        phases.append(("optimizer", opt_start - origin, time.perf_counter() - origin))
        phases += end.meet(origin)
        if self._previous_figures is not None:
            self._previous_figures()  # arrived during this step: frees its buffers, never waits
        self._previous_figures = figures
        return StepStats(
            loss=loss,
            step_s=step_s,
            busy_s=busy,
            in_flight_peak={s: stage.peak_in_flight for s, stage in self.stages.items()},
            pending_w_peak={s: stage.peak_pending_w for s, stage in self.stages.items()},
            timings=tuple(timings),
            phases=tuple(phases),
            skipped=skipped,
            loss_scale=scale,
            pipeline_figures=figures,
        )

    def eval_step(
        self,
        inputs: torch.Tensor | None,
        targets: torch.Tensor | None,
        documents: torch.Tensor | None = None,
    ) -> float:
        """Forward-only loss of a batch, on every rank (`documents` as `train_step`)."""
        try:
            return self._run(
                self.eval_schedule,
                inputs,
                targets,
                training=False,
                origin=time.perf_counter(),
                documents=documents,
            )[1]
        finally:
            if self.fsdp is not None:
                self.fsdp.reshard()

    def _run(
        self,
        schedule: Schedule,
        inputs: torch.Tensor | None,
        targets: torch.Tensor | None,
        *,
        training: bool,
        origin: float,
        documents: torch.Tensor | None = None,
    ) -> tuple[list[ActionTiming], float]:
        """Run this rank's row of `schedule`; its action timings and the global mean loss.

        The batch is checked and split before anything is posted to a peer, so a refused
        batch leaves the engine ready for the next step.
        """
        if self.closed:
            raise RuntimeError("this PipelineEngine is closed: build a new one to run steps")
        if torch.is_autocast_enabled(self.mesh.device.type):
            raise RuntimeError(
                "the step was called inside torch.autocast: the engine casts by itself "
                "(EngineOptions(precision='bf16' or 'fp16')), and an outer autocast would "
                "override its precision and keep weight casts across optimizer steps: call "
                "train_step and eval_step outside autocast"
            )
        context = self._step_context(schedule)
        step = StepRun(context, inputs, targets, training=training, documents=documents)
        self.reports.begin_step()
        for stage in self.stages.values():
            stage.reset_peak()
        clock = step_clock(self.mesh.device)
        with contextlib.ExitStack() as scope:
            if training:
                for stage in self.stages.values():
                    scope.enter_context(stage.step_scope())
            else:
                scope.enter_context(step_casts(self.options.precision, self.mesh.device))
            timings = execute(
                schedule, self.mesh.pp_rank, step.handlers(), clock=clock, origin=origin
            )
        self.exchange.wait_sends()
        return timings, self._global_loss()

    def _step_context(self, schedule: Schedule) -> StepContext:
        every_step = self._end.sums_over_replicas
        dp_reduce = self._dp_reduce.start if every_step else lambda: None
        if self.mesh.tp > 1:
            dp_reduce = functools.partial(
                align_gradients, list(self.module.parameters()), then=dp_reduce
            )
        if self.fsdp is not None:
            dp_reduce = self.fsdp.reduce_gradients
        if self.sharded is not None:
            dp_reduce = self.sharded.start_reduction
            if self._end.ties_before_reduction:
                dp_reduce = lambda: None  # noqa: E731 - started after the tied sum
        return StepContext(
            stages=self.stages,
            row=schedule.rows[self.mesh.pp_rank],
            micro_batches=self.micro_batches,
            loss_divisor=self.micro_batches * (self.mesh.dp if every_step else 1),
            loss_scale=self.scaler.scale if self.scaler is not None else 1.0,
            split_units=self.split_units,
            device=self.mesh.device,
            exchange=self.exchange,
            reports=self.reports,
            gradients_final=dp_reduce,
            releases=released_at(schedule, self.mesh.pp_rank),
            shards=self._shards,
        )

    def _global_loss(self) -> float:
        """The batch's mean loss; a replica's own when replicas step alone (semi-synchronous
        ones leave the dp group idle between meetings, a parameter server's never use it)."""
        loss = self.reports.loss().clone()
        if self.replicas is not None:
            self.replicas.all_reduce(loss).wait()  # the quorum's mean
        elif self.mesh.dp > 1 and not self.replica_sync.alone:
            with naming_failures("the loss's data-parallel mean", timeout_s=self.timeout_s):
                dist.all_reduce(loss, group=self.mesh.dp_group)
            loss /= self.mesh.dp
        return float(loss)

    def close(self, *, wait_for_peers: bool = True) -> None:
        """Release the process groups this engine made (pipeline edges, step reports, tied
        weights); the mesh's own groups stay. Every rank calls it after its last step: by
        default it first reads the last step's figures and waits for every rank at a barrier,
        so no peer still uses a group being torn down. Each engine holds about 20 sockets and
        12 threads per rank until then. A second call does nothing."""
        if self.closed:
            return
        self.closed = True
        if self.param_server is not None:
            self.param_server.close(wait=wait_for_peers)
        if wait_for_peers and self.mesh.world_size > 1:
            with naming_failures("closing the engine (a barrier)", timeout_s=self.timeout_s):
                self.exchange.wait_sends()
                if self._previous_figures is not None:
                    self._previous_figures()
                dist.barrier()
        groups = [*self.channels.edges.values(), self.channels.reports]
        groups += self.ties.groups.values()
        groups += self.param_server.groups if self.param_server is not None else []
        for group in {id(g): g for g in groups if g is not None}.values():
            dist.destroy_process_group(group)

    def __enter__(self) -> PipelineEngine:
        return self

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        self.close(wait_for_peers=kind is None)  # after a failure a peer may never arrive
