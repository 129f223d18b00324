"""What follows a training step's schedule on one rank: the data-parallel reduction's end,
the tied weights' sum, the gradient check, the optimizer step and the replicas' meeting.

Each returns the window it took as a phase of the step (`StepStats.phases`) where it ran, so
the step report and the trace show where the time after the last backward went.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from engine.comm.collective import naming_failures
from engine.comm.grad_sync import BucketedAllReduce
from engine.comm.mesh import Mesh
from engine.comm.replica_group import ReplicaGroup
from engine.comm.ties import TiedWeights
from engine.config import EngineOptions, ReplicaSync
from engine.parallel import ParameterServer, ReplicaMeetings, ShardedOptimizer
from engine.runtime.gradients import StepGradients
from engine.runtime.precision import LossScaler

__all__ = ["Phase", "StepEnd"]

Phase = tuple[str, float, float]
"""A named window of the step: (name, start, end) in seconds from the step's origin."""


@dataclass(frozen=True, kw_only=True, eq=False)
class StepEnd:
    """The parts of one rank's engine that act once its row of the schedule has run."""

    mesh: Mesh
    options: EngineOptions
    timeout_s: float
    dp_reduce: BucketedAllReduce
    sharded: ShardedOptimizer | None
    """ZeRO-1/2's flat buffers, sharded masters and their optimizer."""
    ties: TiedWeights
    gradients: StepGradients
    optimizer: torch.optim.Optimizer | None
    param_server: ParameterServer | None
    meetings: ReplicaMeetings | None
    replicas: ReplicaGroup | None
    replica_sync: ReplicaSync
    scaler: LossScaler | None

    @property
    def synchronises_steps(self) -> bool:
        """Whether every step ends with a blocking all-reduce of the gradient norm over the
        pipeline: clipping and fp16's loss scale need the norm, the non-finite guard needs
        every rank's verdict. Without one, steps follow each other with no barrier."""
        options = self.options
        return options.clip_grad_norm > 0 or options.precision == "fp16" or options.nonfinite_guard

    @property
    def sums_over_replicas(self) -> bool:
        """Whether each step's gradients are summed over the dp replicas (over the mesh's dp
        group, or averaged over a fault-tolerant quorum)."""
        return self.replicas is not None or (self.mesh.dp > 1 and not self.replica_sync.alone)

    @property
    def ties_before_reduction(self) -> bool:
        """ZeRO-2 keeps only a shard of each gradient after its reduce-scatter, so weights
        tied across pipeline ranks are summed over their holders first (within a replica),
        once the whole schedule ran (a holder's last backward may wait on a peer's), and only
        then does the reduction start: such a stage does not overlap it with the drain."""
        return self.sharded is not None and self.sharded.level == 2 and bool(self.ties.groups)

    def finish_dp_reduction(self, origin: float) -> list[Phase]:
        """Wait for the data-parallel gradient sum the stage's last backward started; its
        window as a phase of the step when there are replicas."""
        if self.ties_before_reduction:
            assert self.sharded is not None
            self.ties.sum_gradients()
            self.sharded.start_reduction()
        with naming_failures("the data-parallel gradient reduction", timeout_s=self.timeout_s):
            if self.sharded is not None:
                self.sharded.finish_reduction()
            else:
                self.dp_reduce.finish()
        window = self.dp_reduce.window if self.sharded is None else self.sharded.window
        if window is None or not self.sums_over_replicas:
            return []
        return [("dp all-reduce", window[0] - origin, window[1] - origin)]

    def sum_tied_weights(self, origin: float) -> list[Phase]:
        """Sum the gradients of weights tied across pipeline ranks (unless ZeRO-2 summed them
        before its reduction)."""
        start = time.perf_counter()
        if self.ties_before_reduction:
            return []  # summed before the dp reduction (`finish_dp_reduction`)
        if not self.ties.sum_gradients():
            return []
        return [("tied sum", start - origin, time.perf_counter() - origin)]

    def check_gradients(self, loss: float) -> tuple[float | None, bool]:
        """When steps synchronise: the global norm and whether every rank skips this step
        (unscaled and clipped as the options ask). Otherwise no norm yet, and no skip."""
        if not self.synchronises_steps:
            return None, False
        what = "the pipeline's gradient-norm all-reduce"
        with naming_failures(what, timeout_s=self.timeout_s):
            return self.gradients.finish(loss, self.scaler)

    def optimizer_step(self, skipped: bool) -> float:
        """Step (unless skipped) and update fp16's loss scale; returns the scale this step
        used (1 without one)."""
        if self.param_server is not None:
            with naming_failures("the parameter server (--dp-sync)", timeout_s=self.timeout_s):
                self.param_server.step(skipped)
        elif self.sharded is not None and not skipped:
            self.sharded.step()
        elif self.optimizer is not None and not skipped:
            self.optimizer.step()
        if self.scaler is None:
            return 1.0
        scale = self.scaler.scale
        self.scaler.update(not skipped)
        return scale

    def meet(self, origin: float) -> list[Phase]:
        """Semi-synchronous replicas: count the step and, every H, meet (a phase then)."""
        if self.meetings is None:
            return []
        with naming_failures("the replicas' meeting (--dp-sync)", timeout_s=self.timeout_s):
            met = self.meetings.after_step()
        return [] if met is None else [("replica meeting", met[0] - origin, met[1] - origin)]
