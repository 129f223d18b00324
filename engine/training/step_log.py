"""What a finished step emits: its metrics record, the monitors' scalars, a log line every
--log-every steps, and the FLOPs report of the step --flops-profile-step names; and, when a
run resumes, the metrics of the steps before it, replayed into the log.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.comm.mesh import Mesh
from engine.runtime.step_stats import StepStats
from engine.training.config import TrainConfig
from engine.training.flops_report import flops_report, format_flops_report
from engine.training.metrics import MetricsLog
from engine.training.monitors import Monitors
from engine.training.run import Run

__all__ = ["StepLog", "kept_records", "report_flops"]


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


def report_flops(run: Run, log: MetricsLog, step: int, seconds: float) -> None:
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


def kept_records(path: str | None, start: int) -> list[dict[str, Any]]:
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


@dataclass(frozen=True)
class StepLog:
    """What a finished step emits: its metrics record, the monitors' scalars and, every
    `--log-every` steps, a log line (rank 0 only, above the progress bar)."""

    run: Run
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
