"""The training loop behind `meshpipe train`: one process or a pp × dp × tp mesh of them.

Every rank runs this loop. Only the first stage reads inputs and only the last reads targets;
global rank 0 shows the progress bar and writes the metrics. With --checkpoint-dir the loop
saves every --save-every steps and after the last one; with --resume it first continues from
the checkpoint `latest` names, so ranks restarted by --max-restarts pick up where they died.
Under --fault-tolerant each replica runs `_run_replica_steps`: torchft's quorum decides each
step's number and who sums gradients, and a step it does not commit runs again
(`engine.training.replica_loop`).

Test-only fault injection: with `MESHPIPE_TEST_KILL_AT_STEP=S` in the environment, global rank
`MESHPIPE_TEST_KILL_RANK` (default: the last) SIGKILLs itself as step S begins, on the
launcher's first attempt only (`TORCHELASTIC_RESTART_COUNT` unset or 0), so the restart tests
watch a real crash. Nothing else reads these variables; never set them outside tests.
"""

from __future__ import annotations

import math
import os
import signal
import sys
import time
from dataclasses import dataclass

import torch

from engine.checkpoint.owner import holding_folder
from engine.comm.heartbeat import step_begins
from engine.comm.mesh import Mesh, init_mesh
from engine.comm.replica_group import ReplicaGroup, ReplicaPlace
from engine.runtime.step_stats import StepStats
from engine.training.config import TrainConfig
from engine.training.loaders import open_dataset
from engine.training.metrics import MetricsLog
from engine.training.monitors import Monitors
from engine.training.preflight import (
    check_outputs,
    stage_partition,
)
from engine.training.replica_loop import heal_state, rejoin_note
from engine.training.run import Run, open_run, rank_batch, say
from engine.training.shared_folder import check_shared_folder
from engine.training.step_log import StepLog, kept_records, report_flops
from engine.training.trace import TraceRecorder
from partitioners import Partition

__all__ = [
    "KILL_AT_STEP_ENV",
    "KILL_RANK_ENV",
    "TrainResult",
    "open_dataset",
    "train",
]

KILL_AT_STEP_ENV = "MESHPIPE_TEST_KILL_AT_STEP"
KILL_RANK_ENV = "MESHPIPE_TEST_KILL_RANK"


@dataclass(frozen=True, kw_only=True)
class TrainResult:
    """What a finished run reports."""

    losses: tuple[float, ...]
    """Mean loss of every step, in order."""
    tokens_per_s: float
    """Throughput over the run after its first step (warm-up), or of that step if alone."""
    bubbles: tuple[float, ...] = ()
    """Measured pipeline bubble of every step."""
    first_step: int = 0
    """Step this process started at (> 0 after resuming); `losses[0]` is that step's."""
    val_loss: float | None = None
    """The last validation loss this process measured (None without validation data)."""
    replica: int = 0
    """--fault-tolerant: the replica this process belongs to."""
    missed_steps: int = 0
    """--fault-tolerant: steps this replica missed while it was dead (it healed after)."""

    @property
    def final_loss(self) -> float:
        """Loss of the last step run here (NaN when a resumed run had no steps left)."""
        return self.losses[-1] if self.losses else math.nan

    @property
    def mean_bubble(self) -> float:
        """Mean measured bubble after the first step (warm-up), or of that step if alone."""
        steady = self.bubbles[1:] or self.bubbles
        return sum(steady) / len(steady) if steady else math.nan


def _set_threads(config: TrainConfig, mesh: Mesh) -> None:
    if config.run.threads:
        torch.set_num_threads(config.run.threads)
    else:  # a fault-tolerant replica of one rank still shares the host with the others
        local = int(os.environ.get("LOCAL_WORLD_SIZE", mesh.world_size))
        if local > 1:
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))


def _test_fault(step: int, mesh: Mesh, replica: int = 0, replicas: int = 1) -> None:
    """The test-only crash of the module docstring: SIGKILL, so nothing is cleaned up. A
    fault-tolerant replica's ranks count as `replica · world size + rank`."""
    at = os.environ.get(KILL_AT_STEP_ENV)
    if at is None or int(at) != step or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return
    rank = replica * mesh.world_size + mesh.rank
    if rank == int(os.environ.get(KILL_RANK_ENV, replicas * mesh.world_size - 1)):
        os.kill(os.getpid(), signal.SIGKILL)


def _run_steps(
    run: Run, first: int, emit: StepLog, trace: TraceRecorder | None
) -> tuple[list[StepStats], list[float], list[float]]:
    """Steps `first` to the end, each emitted once the next one ran: its bubble and grad norm
    need every pipeline rank's figures, which have arrived by then without holding any rank
    back (a step about to be saved or followed by an evaluation is emitted at once)."""
    stats: list[StepStats] = []
    wall: list[float] = []
    val_losses: list[float] = []
    pending: tuple[int, StepStats, float, float] | None = None
    for step in range(first, run.config.run.steps):
        step_begins(step)
        _test_fault(step, emit.mesh)
        started = time.perf_counter()
        result, lr, seconds = run.step(step)
        report_flops(run, emit.log, step, seconds)
        if trace is not None:
            trace.record(step, started, result)
        wall.append(seconds)
        stats.append(result)
        if pending is not None:
            emit(*pending)
        pending = (step, result, lr, seconds)
        evaluates = run.evaluates_at(step + 1)
        if run.saves_at(step + 1) or evaluates:
            emit(*pending)
            pending = None
        if evaluates:
            val_losses.append(run.evaluate())
            emit.evaluation(step, val_losses[-1])
        run.save(step + 1)
    if pending is not None:
        emit(*pending)
    return stats, wall, val_losses


def _run_replica_steps(
    run: Run, emit: StepLog, trace: TraceRecorder | None, replicas: ReplicaGroup
) -> tuple[list[StepStats], list[float], list[float]]:
    """Steps until torchft's count reaches --steps; each emitted once committed."""
    steps = run.config.run.steps
    stats: list[StepStats] = []
    wall: list[float] = []
    val_losses: list[float] = []
    reported = False
    while replicas.step < steps:
        step = replicas.begin_step(last=replicas.step == steps - 1)
        if replicas.healed is not None and not reported:
            reported = True
            if replicas.group_rank == 0:
                print(f"meshpipe: {rejoin_note(replicas)}", file=sys.stderr, flush=True)
        if step >= steps:
            break
        step_begins(step)
        _test_fault(step, emit.mesh, replicas.place.replica, replicas.place.replicas)
        lr = float(run.engine.optimizer.param_groups[0]["lr"]) if run.engine.optimizer else 0.0
        started = time.perf_counter()
        result = run.engine.train_step(*rank_batch(run.loader, run.engine, step))
        seconds = time.perf_counter() - started
        if replicas.step == step:  # not committed: the next quorum runs this step again
            if replicas.group_rank == 0:
                print(f"meshpipe: {replicas.refusal(step)}", file=sys.stderr, flush=True)
            continue
        run.scheduler.step()
        if trace is not None:
            trace.record(step, started, result)
        wall.append(seconds)
        stats.append(result)
        emit(step, result, lr, seconds)
        if run.evaluates_at(step + 1):
            val_losses.append(run.evaluate())
            emit.evaluation(step, val_losses[-1])
        run.save(step + 1)
    return stats, wall, val_losses


def train(config: TrainConfig, *, progress: bool = True) -> TrainResult:
    """Train `config.model` on this rank's share of the mesh (one process when pp·dp = 1)."""
    place = ReplicaPlace.from_env() if config.fault_tolerance.fault_tolerant else None
    if place is None or not place.attempt:  # a relaunch finds the checkpoints its run wrote
        check_outputs(config)
    # before the ranks meet: `--partition memory` traces tp stages on a fake world of its own
    partition = stage_partition(config, config.model.specs())
    mesh = init_mesh(
        config.parallel.pp,
        config.parallel.dp if place is None else 1,  # a replica is a world of its own
        config.parallel.tp,
        timeout_s=config.run.timeout,
        device=config.run.device,
        order=config.parallel.mesh_order,
    )
    _set_threads(config, mesh)
    root = config.checkpoint.checkpoint_dir
    if place is not None and place.replica != 0:
        root = None  # replica 0 writes the checkpoints (`engine.training.replica_loop`)
    if root is not None:  # before the owner file is written into it
        check_shared_folder(root, mesh, flag="--checkpoint-dir", timeout_s=config.run.timeout)
    with holding_folder(root, mesh.rank) as note:
        if note is not None:
            say(mesh, note)
        return _train_on(config, mesh, partition, progress=progress, place=place)


def _train_on(
    config: TrainConfig,
    mesh: Mesh,
    partition: Partition,
    *,
    progress: bool,
    place: ReplicaPlace | None = None,
) -> TrainResult:
    """`train` once the mesh is up and this run holds its checkpoint folder."""
    run = open_run(config, mesh, place, partition)
    first = run.restore()
    if run.replicas is not None:
        heal_state(run.engine, run.scheduler, run.replicas)
        run.replicas.set_step(first)
        run.replicas.joined()
    leads = mesh.rank == 0 and (place is None or place.replica == 0)
    profiled = config.monitor.flops_profile_step
    if 0 < profiled <= first:
        say(mesh, f"no FLOPs report: step {profiled} ran before the resumed step {first + 1}")
    path = config.run.metrics_file if leads else None
    relaunched = place is not None and place.attempt > 0
    kept = kept_records(path, config.run.steps if relaunched else first)
    trace = TraceRecorder() if config.run.trace else None
    show = progress and leads
    monitors = Monitors(config.monitor, enabled=leads)
    with (
        MetricsLog(total_steps=config.run.steps, path=path, progress=show, kept=kept) as log,
        monitors,
    ):
        emit = StepLog(run=run, log=log, monitors=monitors, mesh=mesh, leads=leads)
        if run.replicas is None:
            stats, wall, val_losses = _run_steps(run, first, emit, trace)
        else:
            stats, wall, val_losses = _run_replica_steps(run, emit, trace, run.replicas)
            first = config.run.steps - len(stats) if stats else first  # after a heal, later
    run.engine.close()
    if run.replicas is not None:
        run.replicas.shutdown()
    if trace is not None and config.run.trace is not None:
        trace.write(config.run.trace, rank=mesh.rank, world_size=mesh.world_size)
        say(mesh, f"wrote trace {config.run.trace}")
    tokens_per_step = config.batch.global_batch * config.batch.seq_len
    timed = wall[1:] or wall
    steady = tokens_per_step * len(timed) / sum(timed) if timed else 0.0
    return TrainResult(
        losses=tuple(s.loss for s in stats),
        tokens_per_s=steady,
        bubbles=tuple(s.bubble for s in stats),
        first_step=first,
        val_loss=val_losses[-1] if val_losses else None,
        replica=place.replica if place is not None else 0,
        missed_steps=run.replicas.missed_steps if run.replicas is not None else 0,
    )
