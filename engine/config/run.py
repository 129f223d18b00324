"""What a training run is beyond its model and layout: its length, seed, data, where its
ranks run, what it writes, and its checkpoints."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.config.fields import flat, require

__all__ = [
    "DATA_ORDERS",
    "DEVICES",
    "CheckpointConfig",
    "DataConfig",
    "MonitorConfig",
    "RunConfig",
]

DEVICES = ("auto", "cuda", "cpu")
"""Where ranks may be placed (`meshpipe train --device`)."""

DATA_ORDERS = ("epochs", "random")
"""How the training batches are drawn (`meshpipe train --data-order`)."""


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """The run itself: steps, seed, where ranks compute, what they write, how long they wait."""

    steps: int = 100
    """Optimizer steps to run."""
    seed: int = 0
    """Seed of weights and data order."""
    threads: int = 0
    """Intra-op threads per process; 0 leaves torch's default."""
    device: str = "auto"
    """auto: CUDA with NCCL when the host has a GPU per rank, else the CPU with gloo. cuda:
    on GPUs even when ranks share them (gloo then, activations staged through host memory).
    cpu: on the CPU with gloo."""
    timeout: float = 300.0
    """Seconds any collective or p2p call may wait before failing (dead or stalled peer)."""
    metrics_file: str | None = None
    """Path of a JSON-lines file receiving one record per step."""
    trace: str | None = None
    """Write the measured per-rank timeline of the run as a Chrome/Perfetto trace (JSON)."""
    log_every: int = 0
    """Also print a log line every N steps (loss, tokens/s, bubble); 0 prints none."""
    max_restarts: int = 0
    """Local launcher: restart all ranks up to N times when one dies (needs --resume); with
    --fault-tolerant, relaunch only the dead rank's replica, up to N times each."""

    def __post_init__(self) -> None:
        require(self.steps >= 1, f"steps={self.steps} must be at least 1")
        require(self.threads >= 0, f"threads={self.threads} must be >= 0")
        require(
            self.device in DEVICES,
            f"unknown device {self.device!r}: choose one of {', '.join(DEVICES)}",
        )
        require(self.timeout > 0, f"timeout={self.timeout} must be positive")
        require(self.log_every >= 0, f"log_every={self.log_every} must be >= 0 (0: never)")
        require(self.max_restarts >= 0, f"max_restarts={self.max_restarts} must be >= 0")


@dataclass(frozen=True, kw_only=True)
class MonitorConfig:
    """What rank 0 also writes each step beyond --metrics-file (DeepSpeed's monitors), and
    what its log lines show."""

    tensorboard_dir: str | None = None
    """Write the train loss, lr (and fp16's loss scale) of every step as TensorBoard scalars
    into this folder, tagged as DeepSpeed tags them (needs the tensorboard package)."""
    csv_dir: str | None = None
    """Write them as CSV files into this folder, one per value, named as DeepSpeed's
    csv_monitor names them (Train_Samples_train_loss.csv)."""
    wandb_project: str | None = None
    """Log them to this Weights & Biases project, offline (`wandb sync` uploads later)."""
    wandb_group: str | None = None
    """The Weights & Biases group of the run (with --wandb-project)."""
    log_phases: bool = False
    """Add rank 0's seconds per phase of the step (forward, backward, all-reduce, optimizer)
    to each --log-every line (DeepSpeed's wall_clock_breakdown)."""
    flops_profile_step: int = 0
    """Rank 0 prints a FLOPs report of step N (counted from 1, as log lines count): per stage
    its layers, parameters, forward and training FLOPs, and the TFLOP/s the step achieved per
    rank and over the mesh (DeepSpeed's flops_profiler); 0 prints none."""
    flops_profile_file: str | None = None
    """Also write the FLOPs report into this file (with --flops-profile-step)."""
    device_peak_tflops: float = 0.0
    """Peak dense TFLOP/s of one accelerator at the run's precision (989 for an H100 SXM in
    bf16), so the FLOPs report shows MFU; 0 leaves MFU out."""

    def __post_init__(self) -> None:
        require(
            self.wandb_group is None or self.wandb_project is not None,
            f"--wandb-group {self.wandb_group} needs --wandb-project: add it",
        )
        require(
            self.flops_profile_step >= 0,
            f"flops_profile_step={self.flops_profile_step} must be >= 0 (0: no FLOPs report)",
        )
        require(
            self.device_peak_tflops >= 0,
            f"device_peak_tflops={self.device_peak_tflops} must be >= 0 (0: no MFU)",
        )
        for flag, used in (
            ("--flops-profile-file", self.flops_profile_file is not None),
            ("--device-peak-tflops", self.device_peak_tflops > 0),
        ):
            require(
                self.flops_profile_step > 0 or not used,
                f"{flag} only applies to the FLOPs report: add --flops-profile-step N",
            )


def _vocab_size(value: Any) -> int:
    """--vocab-size as given on the command line or read back from a checkpoint."""
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"--vocab-size {value!r} is not a number of tokens, e.g. 50257") from None


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """What the run trains on."""

    data: str | None = None
    """Prepared token file, or `nanogpt:PATH` (nanoGPT's raw uint16 .bin, with --vocab-size);
    None uses the embedded default corpus."""
    vocab_size: int | None = field(default=None, metadata=flat(parse=_vocab_size))
    """Vocabulary of a raw token file (`--data nanogpt:PATH`), which has no header to say it."""
    tokenizer: str | None = None
    """The tokenizer (a tokenizer.json or a folder holding one) of a raw token file, carried
    into checkpoints; a prepared file's header names its own."""
    data_order: str = "epochs"
    """epochs: shuffled passes over the data, every window once per epoch (documents shuffled
    too when the file has an eos_id); random: each window's start drawn uniformly, with
    replacement (meshpipe's order before epochs)."""
    pack_documents: bool = False
    """Reset positions at each document start and keep attention within documents (needs a
    token file with an eos_id)."""
    val_data: str | None = None
    """Prepared token file to measure the validation loss on."""
    val_fraction: float = 0.0
    """Hold out this fraction of the documents (of the tokens, at the end, in a file without
    eos_id) of --data for the validation loss; 0 holds out none."""
    eval_every: int = 0
    """Measure the validation loss every N steps and after the last; 0: after the last only
    (with --val-data or --val-fraction)."""
    eval_batches: int = 8
    """Global batches of validation data each measurement averages (the same ones each time)."""

    def __post_init__(self) -> None:
        require(
            self.data_order in DATA_ORDERS,
            f"unknown data order {self.data_order!r}: choose one of {', '.join(DATA_ORDERS)}",
        )
        require(
            0 <= self.val_fraction < 1,
            f"val_fraction={self.val_fraction} must lie in [0, 1), e.g. 0.05 (0: no split)",
        )
        require(
            self.val_data is None or self.val_fraction == 0,
            "--val-data and --val-fraction both name validation data: give one of them",
        )
        require(self.eval_every >= 0, f"eval_every={self.eval_every} must be >= 0")
        require(self.eval_batches >= 1, f"eval_batches={self.eval_batches} must be >= 1")
        require(
            self.eval_every == 0 or self.validates,
            f"--eval-every {self.eval_every} needs validation data: add --val-data PATH or "
            "--val-fraction F",
        )

    @property
    def validates(self) -> bool:
        """Whether the run measures a validation loss."""
        return self.val_data is not None or self.val_fraction > 0


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """Where a run saves and what it resumes or starts from."""

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

    def __post_init__(self) -> None:
        for name in ("save_every", "keep"):
            value = getattr(self, name)
            require(value >= 0, f"{name}={value} must be >= 0")
        for flag, used in (
            ("--save-every", self.save_every > 0),
            ("--keep", self.keep > 0),
            ("--resume", self.resume),
        ):
            require(
                self.checkpoint_dir is not None or not used,
                f"{flag} needs a --checkpoint-dir to save into or resume from",
            )
        for flag, used in (
            ("--resume-fallback", self.resume_fallback),
            ("--resume-with-new-hparams", self.resume_with_new_hparams),
        ):
            require(self.resume or not used, f"{flag} only applies with --resume: add --resume")
