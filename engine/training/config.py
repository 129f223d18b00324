"""Typed configuration of a training run, validated once before any compute."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

from engine.comm.mesh import DEVICES
from engine.runtime.optim import LR_SCHEDULES, OPTIMIZERS, OptimizerSpec
from engine.runtime.options import EngineOptions
from engine.schedule.actions import split_units
from engine.schedule.resolve import schedule_for
from engine.training.deepspeed_config import (
    DEEPSPEED_SCHEDULERS,
    deepspeed_defaults,
    deepspeed_overrides,
    read_deepspeed_config,
)
from models import get_config, layer_specs

__all__ = ["TrainConfig"]


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Everything that defines a training run; two runs with equal configs are identical."""

    model: str = "gpt-tiny"
    """Name of a registered model config (see `models.MODEL_CONFIGS`)."""
    steps: int = 100
    """Optimizer steps to run."""
    global_batch: int = 16
    """Sequences per optimizer step, over all data-parallel replicas."""
    micro_batches: int = 4
    """Micro-batches each replica's batch is split into (gradient accumulation)."""
    seq_len: int = 128
    """Tokens per sequence; at most the model's context."""
    lr: float = 3e-3
    """Peak learning rate."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of `lr` for decaying schedules."""
    lr_schedule: str = "cosine"
    """One of `constant`, `cosine`, `linear` (after warmup)."""
    warmup_steps: int = 10
    """Steps of linear warmup from lr/warmup_steps to lr."""
    optimizer: str = "adamw"
    """`adamw` or `sgd`."""
    optimizer_impl: str = "fused"
    """Optimizer kernel: fused (torch), per_tensor (torch) or deepspeed_cpu (AdamW only)."""
    weight_decay: float = 0.1
    """Decoupled weight decay on matrices (not on norms and biases)."""
    seed: int = 0
    """Seed of weights and data order."""
    data: str | None = None
    """Prepared token file; None uses the embedded default corpus."""
    threads: int = 0
    """Intra-op threads per process; 0 leaves torch's default."""
    device: str = "auto"
    """auto: CUDA with NCCL when the host has a GPU per rank, else the CPU with gloo. cuda:
    on GPUs even when ranks share them (gloo then, activations staged through host memory).
    cpu: on the CPU with gloo."""
    metrics_file: str | None = None
    """Path of a JSON-lines file receiving one record per step."""
    pp: int = 1
    """Pipeline stages (ranks per pipeline)."""
    dp: int = 1
    """Data-parallel replicas of the pipeline."""
    schedule: str = "1f1b"
    """Pipeline schedule: gpipe, 1f1b, interleaved_1f1b, looped_bfs, zb_h1, zb_h2 or zb_drain,
    or a schedule file (meshpipe schedule --out FILE, or rows of actions written by hand)."""
    partition: str = "balanced"
    """Partition method: uniform, parameters, balanced, type:<regex>, boundaries:…, balance:…"""
    timeout: float = 300.0
    """Seconds any collective or p2p call may wait before failing (dead or stalled peer)."""
    stages_per_rank: int = 1
    """Stages per pipeline rank (v > 1 with interleaved_1f1b or looped_bfs)."""
    precision: str = "fp32"
    """fp32, bf16 (autocast, fp32 master weights and grads) or fp16 (plus loss scaling)."""
    clip_grad_norm: float = 0.0
    """Clip the global gradient norm to this value (0 disables)."""
    recompute: str = "none"
    """Activation recomputation per stage: none, full or every:N layers."""
    compile: bool = False
    """torch.compile each layer (fused norms, rotary, activations; not with zb_* schedules)."""
    zero: int = 0
    """1 shards the optimizer state over the data-parallel replicas (ZeRO-1)."""
    no_nonfinite_guard: bool = False
    """Apply steps without first agreeing across ranks that all gradients are finite: with no
    clipping and no fp16, steps then follow each other without a barrier (faster)."""
    betas: str = "0.9,0.95"
    """AdamW's betas, comma-separated."""
    momentum: float = 0.0
    """SGD's momentum."""
    adam_eps: float = 1e-8
    """AdamW's epsilon, added to the root of the second moment (Llama recipes use 1e-5)."""
    lr_schedule_args: str = "{}"
    """JSON parameters of a deepspeed:<Type> lr schedule (WarmupLR, WarmupDecayLR, …)."""
    trace: str | None = None
    """Write the measured per-rank timeline of the run as a Chrome/Perfetto trace (JSON)."""
    log_every: int = 0
    """Also print a log line every N steps (loss, tokens/s, bubble); 0 prints none."""
    checkpoint_dir: str | None = None
    """Folder of checkpoints (`step-NNNNNNNN` and a `latest` pointer); None saves none."""
    save_every: int = 0
    """Save a checkpoint every N steps; the last step is always saved (0: only the last)."""
    keep: int = 0
    """Keep only the newest N checkpoints (0 keeps all)."""
    resume: bool = False
    """Continue from the checkpoint `latest` names in --checkpoint-dir, if there is one."""
    resume_fallback: bool = False
    """If `latest` fails to load, use the previous complete checkpoint (said on stderr)."""
    resume_with_new_hparams: bool = False
    """With --resume, continue with this run's learning rate, schedule, optimizer, clipping
    and precision where they differ from the checkpoint's (such a resume is refused otherwise)."""
    init_from: str | None = None
    """Start from the weights of a checkpoint or a Hugging Face folder (fresh optimizer)."""
    max_restarts: int = 0
    """Local launcher: restart all ranks up to N times when one dies (needs --resume)."""

    def __post_init__(self) -> None:
        for name in ("steps", "global_batch", "micro_batches", "seq_len"):
            value = getattr(self, name)
            _require(value >= 1, f"{name}={value} must be at least 1")
        _require(
            self.global_batch % self.micro_batches == 0,
            f"global batch {self.global_batch} does not split into {self.micro_batches} "
            "micro-batches: choose --global-batch as a multiple of --micro-batches",
        )
        _require(self.lr > 0, f"lr={self.lr} must be positive")
        _require(0.0 <= self.min_lr_ratio <= 1.0, f"min_lr_ratio={self.min_lr_ratio} not in [0, 1]")
        _require(self.warmup_steps >= 0, f"warmup_steps={self.warmup_steps} must be >= 0")
        _require(
            0.0 < self.adam_eps < float("inf"),
            f"adam_eps={self.adam_eps} must be a positive number such as 1e-8",
        )
        deepspeed_schedules = [f"deepspeed:{k}" for k in DEEPSPEED_SCHEDULERS]
        _require(
            self.lr_schedule in (*LR_SCHEDULES, *deepspeed_schedules),
            f"unknown lr schedule {self.lr_schedule!r}: choose one of "
            f"{', '.join((*LR_SCHEDULES, *deepspeed_schedules))}",
        )
        self._check_schedule_args()
        _require(self.weight_decay >= 0, f"weight_decay={self.weight_decay} must be >= 0")
        _require(0 <= self.momentum < 1, f"momentum={self.momentum} must be in [0, 1)")
        _require(self.log_every >= 0, f"log_every={self.log_every} must be >= 0 (0: never)")
        self.engine_options()
        self.optimizer_spec()
        _require(
            self.optimizer in OPTIMIZERS,
            f"unknown optimizer {self.optimizer!r}: choose one of {', '.join(OPTIMIZERS)}",
        )
        _require(self.threads >= 0, f"threads={self.threads} must be >= 0")
        _require(self.pp >= 1 and self.dp >= 1, f"pp={self.pp} and dp={self.dp} must be >= 1")
        _require(self.timeout > 0, f"timeout={self.timeout} must be positive")
        _require(
            self.global_batch % (self.dp * self.micro_batches) == 0,
            f"global batch {self.global_batch} does not split into {self.dp} replicas × "
            f"{self.micro_batches} micro-batches: use a multiple of {self.dp * self.micro_batches}",
        )
        schedule = schedule_for(
            self.schedule,
            num_ranks=self.pp,
            micro_batches=self.micro_batches,
            stages_per_rank=self.stages_per_rank,
        )
        _require(
            not (self.compile and any(split_units(row) for row in schedule.rows)),
            f"--compile with schedule {self.schedule}: its split backward defers each Linear's "
            "weight gradient, which a compiled layer hides; use 1f1b, gpipe, interleaved_1f1b "
            "or looped_bfs with --compile, or drop --compile",
        )
        _require(
            self.device in DEVICES,
            f"unknown device {self.device!r}: choose one of {', '.join(DEVICES)}",
        )
        self._check_checkpointing()
        num_layers = len(layer_specs(self.model))
        stages = self.pp * self.stages_per_rank
        _require(
            stages <= num_layers,
            f"cannot split {self.model}'s {num_layers} layers into {stages} stages: "
            f"use fewer pipeline ranks or stages per rank (at most {num_layers} stages)",
        )
        context = get_config(self.model).max_seq_len
        _require(
            self.seq_len <= context,
            f"seq_len={self.seq_len} is longer than {self.model}'s context of {context} tokens: "
            f"use --seq-len {context} or less",
        )

    def _check_checkpointing(self) -> None:
        for name in ("save_every", "keep", "max_restarts"):
            value = getattr(self, name)
            _require(value >= 0, f"{name}={value} must be >= 0")
        for flag, used in (
            ("--save-every", self.save_every > 0),
            ("--keep", self.keep > 0),
            ("--resume", self.resume),
        ):
            _require(
                self.checkpoint_dir is not None or not used,
                f"{flag} needs a --checkpoint-dir to save into or resume from",
            )
        for flag, used in (
            ("--resume-fallback", self.resume_fallback),
            ("--resume-with-new-hparams", self.resume_with_new_hparams),
        ):
            _require(self.resume or not used, f"{flag} only applies with --resume: add --resume")
        _require(
            self.resume or self.max_restarts == 0,
            f"--max-restarts {self.max_restarts} restarts would start over from step 0: "
            "add --resume (and --save-every) so restarted ranks continue from the last checkpoint",
        )

    def _check_schedule_args(self) -> None:
        """--lr-schedule-args is a DeepSpeed scheduler's JSON parameters, and only that."""
        if not self.lr_schedule.startswith("deepspeed:"):
            _require(
                _json_object(self.lr_schedule_args) == {},
                f"--lr-schedule-args {self.lr_schedule_args} is for the deepspeed:* schedules; "
                f"--lr-schedule {self.lr_schedule} takes --warmup-steps and --min-lr-ratio",
            )
            return
        _require(
            _json_object(self.lr_schedule_args) is not None,
            f"--lr-schedule-args {self.lr_schedule_args!r} is not a JSON object: give the "
            "scheduler's parameters such as '{\"warmup_num_steps\": 100}'",
        )

    def optimizer_spec(self) -> OptimizerSpec:
        """The optimizer these fields describe (validated)."""
        try:
            betas = tuple(float(b) for b in self.betas.split(","))
        except ValueError:
            betas = ()
        _require(len(betas) == 2, f"betas={self.betas!r}: give two numbers such as 0.9,0.95")
        _require(all(0 <= b < 1 for b in betas), f"betas={self.betas!r}: each must be in [0, 1)")
        return OptimizerSpec(
            name=self.optimizer,
            lr=self.lr,
            weight_decay=self.weight_decay,
            betas=(betas[0], betas[1]),
            momentum=self.momentum,
            eps=self.adam_eps,
            impl=self.optimizer_impl,
        )

    def engine_options(self) -> EngineOptions:
        return EngineOptions(
            precision=self.precision,
            clip_grad_norm=self.clip_grad_norm,
            recompute=self.recompute,
            zero=self.zero,
            compile=self.compile,
            nonfinite_guard=not self.no_nonfinite_guard,
        )

    @staticmethod
    def from_deepspeed(path: str, **fields: Any) -> TrainConfig:
        """A config whose batch, optimizer, schedule, precision, clipping, ZeRO, partition,
        recompute and seed come from a DeepSpeed JSON; `fields` give the rest (model, pp, dp…)
        and must not contradict the JSON. A setting the JSON omits takes DeepSpeed's default
        (`deepspeed_defaults`: clipping at 1.0, its optimizer's betas, eps and weight decay, a
        constant lr) unless `fields` give it, so a DeepSpeed config trains alike."""
        json_config = read_deepspeed_config(path)
        overrides = deepspeed_overrides(json_config, dp=int(fields.get("dp", 1)))
        for name, value in deepspeed_defaults(json_config).items():
            if name not in overrides and name not in fields:
                overrides[name] = value
        if isinstance(overrides.get("betas"), tuple):
            overrides["betas"] = ",".join(str(b) for b in overrides["betas"])
        return TrainConfig(**{**fields, **overrides})

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _json_object(text: str) -> dict[str, Any] | None:
    """`text` parsed as a JSON object, or None when it is not one."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None
