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

import json
import math
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.optim.lr_scheduler import LambdaLR

from engine.checkpoint import (
    TrainerState,
    has_checkpoint,
    load_checkpoint,
    load_model_weights,
    save_checkpoint,
)
from engine.checkpoint.hf_interop import open_weights
from engine.checkpoint.owner import holding_folder
from engine.comm.heartbeat import step_begins
from engine.comm.mesh import Mesh, init_mesh
from engine.comm.replica_group import ReplicaGroup, ReplicaPlace
from engine.runtime.engine import PipelineEngine
from engine.runtime.lr_schedules import lr_multiplier
from engine.runtime.step_stats import StepStats
from engine.training.batches import BatchLoader
from engine.training.config import TrainConfig
from engine.training.flops_report import flops_report, format_flops_report
from engine.training.loaders import RunData, open_data, open_dataset
from engine.training.metrics import MetricsLog
from engine.training.monitors import Monitors
from engine.training.preflight import (
    check_before_loading,
    check_outputs,
    stage_partition,
)
from engine.training.replica_loop import heal_state, rejoin_note
from engine.training.resume_check import (
    check_resumable,
    keep_new_hyperparameters,
    optimizer_hyperparameters,
)
from engine.training.run_data import tokenizer_files
from engine.training.shared_folder import check_shared_folder
from engine.training.trace import TraceRecorder
from models import LayerSpec
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


def _build_engine(
    config: TrainConfig,
    mesh: Mesh,
    specs: list[LayerSpec],
    partition: Partition,
    replicas: ReplicaGroup | None = None,
) -> PipelineEngine:
    return PipelineEngine(
        specs,
        mesh,
        partition=partition,
        micro_batches=config.schedule.micro_batches,
        schedule=(  # a placement asked for: the schedule under it, as data
            config.schedule.schedule
            if config.schedule.placement is None
            else config.schedule.resolve(mesh.pp)
        ),
        stages_per_rank=config.schedule.stages_per_rank,
        seed=config.run.seed,
        optimizer=config.optimizer,
        timeout_s=config.run.timeout,
        options=config.engine,
        replica_sync=config.replica_sync,
        replicas=replicas,
    )


@dataclass(frozen=True, kw_only=True)
class _Run:
    """The pieces of a run that the loop, the checkpoints and resume all touch."""

    config: TrainConfig
    engine: PipelineEngine
    specs: list[LayerSpec]
    partition: Partition
    data: RunData
    scheduler: LambdaLR
    replicas: ReplicaGroup | None = None
    """--fault-tolerant: this replica's torchft group."""

    @property
    def loader(self) -> BatchLoader:
        return self.data.train

    def step(self, step: int) -> tuple[StepStats, float, float]:
        """Train one step; returns its stats, the learning rate it used and its seconds."""
        engine = self.engine
        assert engine.optimizer is not None
        inputs, targets, documents = _batch(self.loader, engine, step)
        lr = float(engine.optimizer.param_groups[0]["lr"])
        start = time.perf_counter()
        stats = engine.train_step(inputs, targets, documents)
        self.scheduler.step()
        return stats, lr, time.perf_counter() - start

    def evaluates_at(self, done: int) -> bool:
        """Whether the validation loss is measured after `done` steps."""
        every = self.config.data.eval_every
        due = done == self.config.run.steps or (every > 0 and done % every == 0)
        return self.data.val is not None and due

    def evaluate(self) -> float:
        """Mean validation loss over --eval-batches batches, through the pipeline
        (collective: every rank of the mesh calls it)."""
        assert self.data.val is not None
        losses = [
            self.engine.eval_step(*_batch(self.data.val, self.engine, k))
            for k in range(self.config.data.eval_batches)
        ]
        return sum(losses) / len(losses)

    def saves_at(self, done: int) -> bool:
        """Whether a checkpoint is written after `done` steps."""
        config = self.config
        every = config.checkpoint.save_every > 0 and done % config.checkpoint.save_every == 0
        writer = self.replicas is None or self.replicas.place.replica == 0
        due = every or done == config.run.steps
        return config.checkpoint.checkpoint_dir is not None and writer and due

    def save(self, done: int) -> None:
        """Checkpoint after `done` steps, when the config asks for it (collective)."""
        config = self.config
        if config.checkpoint.checkpoint_dir is None or not self.saves_at(done):
            return
        state = TrainerState(
            step=done,
            loader={**self.loader.state_dict(), "position": done},
            scheduler=self.scheduler.state_dict(),
            config=config.flat(),
            loss_scale=self.engine.scaler.state_dict() if self.engine.scaler else {},
            skipped_steps=self.engine.skipped_steps,
            tokenizer=tokenizer_files(self.loader.dataset.info, config.data.tokenizer),
        )
        save_checkpoint(
            self.engine,
            self.specs,
            config.checkpoint.checkpoint_dir,
            state=state,
            keep=config.checkpoint.keep,
        )

    def restore(self) -> int:
        """Resume from `latest` or start from --init-from weights; returns the first step."""
        config, engine = self.config, self.engine
        root = config.checkpoint.checkpoint_dir
        if self.replicas is not None and self.replicas.place.attempt:
            return 0  # a relaunched replica heals from a live one, not from disk
        if config.checkpoint.resume and root is not None and has_checkpoint(root):
            assert engine.optimizer is not None
            check_before_loading(root, config)
            built = optimizer_hyperparameters(engine.optimizer)
            where, state = load_checkpoint(
                engine, self.specs, root, fallback=config.checkpoint.resume_fallback
            )
            changed = check_resumable(state.config, config, state.step, str(where))
            self.scheduler.load_state_dict(state.scheduler)
            if changed:
                keep_new_hyperparameters(engine.optimizer, self.scheduler, built)
                _say(engine.mesh, f"continuing with new settings ({changed})")
            self.loader.load_state_dict(state.loader)
            if engine.scaler is not None and state.loss_scale:
                engine.scaler.load_state_dict(state.loss_scale)
            engine.skipped_steps = state.skipped_steps
            _say(engine.mesh, f"resumed from step {state.step} ({where})")
            if engine.meetings is not None:
                _say(engine.mesh, _SHARED_INNER_STATE)
            return state.step
        if config.checkpoint.init_from is not None:
            source = open_weights(config.checkpoint.init_from, config.model.config())
            load_model_weights(engine, self.specs, source)
            _say(engine.mesh, f"initialised from {config.checkpoint.init_from}")
        return 0


_SHARED_INNER_STATE = (
    "every replica resumes with the first replica's inner optimizer state: a checkpoint, "
    "taken at a meeting, keeps one copy of the weights and of that state (exact for plain SGD)"
)


def _log_line(record: dict[str, Any], skipped: int, phases: dict[str, float] | None) -> str:
    line = (
        f"step {record['step'] + 1}: loss {record['loss']:.4f}, "
        f"{record['tokens_per_s']:,.0f} tokens/s, bubble {record['bubble']:.1%}, "
        f"grad norm {record['grad_norm']:.3g}, lr {record['lr']:.3g}, skipped {skipped}"
    )
    if phases is None:
        return line
    return line + "; ms " + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in phases.items())


def _monitor_values(config: TrainConfig, result: StepStats, lr: float) -> dict[str, float]:
    """The values DeepSpeed's monitors receive each step: train loss, lr, fp16's scale."""
    values = {"train_loss": result.loss, "lr": lr}
    if config.engine.precision == "fp16":
        values["loss_scale"] = result.loss_scale
    return values


def _report_flops(run: _Run, log: MetricsLog, step: int, seconds: float) -> None:
    """Rank 0's FLOPs report of `step` (from 0), when --flops-profile-step names it."""
    config = run.config
    if run.engine.mesh.rank != 0 or config.monitor.flops_profile_step != step + 1:
        return
    placement = run.engine.schedule.placement
    report = flops_report(
        config, run.specs, run.partition, placement, step=step + 1, seconds=seconds
    )
    text = format_flops_report(report)
    log.say(text)
    path = config.monitor.flops_profile_file
    if path is not None:
        Path(path).write_text(text + "\n", encoding="utf-8")
        log.say(f"meshpipe: wrote the FLOPs report to {path}")


def _say(mesh: Mesh, message: str) -> None:
    if mesh.rank == 0:
        print(f"meshpipe: {message}", file=sys.stderr, flush=True)


def _test_fault(step: int, mesh: Mesh, replica: int = 0, replicas: int = 1) -> None:
    """The test-only crash of the module docstring: SIGKILL, so nothing is cleaned up. A
    fault-tolerant replica's ranks count as `replica · world size + rank`."""
    at = os.environ.get(KILL_AT_STEP_ENV)
    if at is None or int(at) != step or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return
    rank = replica * mesh.world_size + mesh.rank
    if rank == int(os.environ.get(KILL_RANK_ENV, replicas * mesh.world_size - 1)):
        os.kill(os.getpid(), signal.SIGKILL)


def _kept_records(path: str | None, start: int) -> list[dict[str, Any]]:
    """Metrics of the steps before `start`, replayed into the log when a run resumes."""
    if path is None or start == 0 or not Path(path).is_file():
        return []
    kept = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by the crash
        if isinstance(record, dict) and record.get("step", start) < start:
            kept.append(record)
    return kept


def _batch(
    loader: BatchLoader, engine: PipelineEngine, step: int
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """What this rank's stages read of batch `step`: inputs on the first, targets on the last,
    the document ids on every one when documents are packed."""
    if not (loader.pack_documents or engine.is_first or engine.is_last):
        return None, None, None
    batch = loader.sample(step)
    return batch.inputs, batch.targets, batch.documents


def _open_run(
    config: TrainConfig, mesh: Mesh, place: ReplicaPlace | None, partition: Partition
) -> _Run:
    replicas = None if place is None else ReplicaGroup(place, timeout_s=config.run.timeout)
    data = open_data(config, dp_rank=mesh.dp_rank if place is None else place.replica)
    specs = config.model.specs()
    engine = _build_engine(config, mesh, specs, partition, replicas)
    assert engine.optimizer is not None
    lr = config.optimizer.lr
    multiplier = lr_multiplier(config.learning_rate, total_steps=config.run.steps, lr=lr)
    scheduler = LambdaLR(engine.optimizer, multiplier)
    return _Run(
        config=config,
        engine=engine,
        specs=specs,
        partition=partition,
        data=data,
        scheduler=scheduler,
        replicas=replicas,
    )


@dataclass(frozen=True)
class _StepLog:
    """What a finished step emits: its metrics record, the monitors' scalars and, every
    `--log-every` steps, a log line (rank 0 only, above the progress bar)."""

    run: _Run
    log: MetricsLog
    monitors: Monitors
    mesh: Mesh
    leads: bool = True
    """Whether this rank writes the log lines (global rank 0; replica 0's under
    --fault-tolerant)."""

    def __call__(self, step: int, result: StepStats, lr: float, seconds: float) -> None:
        config = self.run.config
        tokens = config.batch.global_batch * config.batch.seq_len
        record = {
            "step": step,
            "loss": result.loss,
            "lr": lr,
            "step_s": seconds,
            "tokens_per_s": tokens / seconds,
            "bubble": result.bubble,
            "grad_norm": result.grad_norm,
            "skipped": result.skipped,
        }
        self.log.record(**record)
        samples = (step + 1) * config.batch.global_batch
        self.monitors.write(samples, _monitor_values(config, result, lr))
        due = config.run.log_every and (step + 1) % config.run.log_every == 0
        if due and self.leads:
            phases = result.phase_seconds() if config.monitor.log_phases else None
            line = _log_line(record, self.run.engine.skipped_steps, phases)
            self.log.say(f"meshpipe: {line}")

    def evaluation(self, step: int, val_loss: float) -> None:
        """The validation loss measured after `step` (from 0): its own record, kind "eval"."""
        self.log.record(kind="eval", step=step, val_loss=val_loss)
        self.monitors.write((step + 1) * self.run.config.batch.global_batch, {"val_loss": val_loss})
        if self.leads:
            self.log.say(f"meshpipe: step {step + 1}: val loss {val_loss:.4f}")


def _run_steps(
    run: _Run, first: int, emit: _StepLog, trace: TraceRecorder | None
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
        _report_flops(run, emit.log, step, seconds)
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
    run: _Run, emit: _StepLog, trace: TraceRecorder | None, replicas: ReplicaGroup
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
        result = run.engine.train_step(*_batch(run.loader, run.engine, step))
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
            _say(mesh, note)
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
    run = _open_run(config, mesh, place, partition)
    first = run.restore()
    if run.replicas is not None:
        heal_state(run.engine, run.scheduler, run.replicas)
        run.replicas.set_step(first)
        run.replicas.joined()
    leads = mesh.rank == 0 and (place is None or place.replica == 0)
    profiled = config.monitor.flops_profile_step
    if 0 < profiled <= first:
        _say(mesh, f"no FLOPs report: step {profiled} ran before the resumed step {first + 1}")
    path = config.run.metrics_file if leads else None
    relaunched = place is not None and place.attempt > 0
    kept = _kept_records(path, config.run.steps if relaunched else first)
    trace = TraceRecorder() if config.run.trace else None
    show = progress and leads
    monitors = Monitors(config.monitor, enabled=leads)
    with (
        MetricsLog(total_steps=config.run.steps, path=path, progress=show, kept=kept) as log,
        monitors,
    ):
        emit = _StepLog(run=run, log=log, monitors=monitors, mesh=mesh, leads=leads)
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
        _say(mesh, f"wrote trace {config.run.trace}")
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
