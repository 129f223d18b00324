"""How each step computes on every stage and rank: precision, recomputation, clipping, the
non-finite guard, ZeRO, compiled layers."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

from engine.config.fields import flat, require

__all__ = [
    "LOSS_SCALE_FIELDS",
    "PRECISIONS",
    "ZERO_LEVELS",
    "ZERO_RESHARDS",
    "EngineOptions",
    "check_zero_optimizer",
    "parse_stages",
    "recompute_groups",
]

PRECISIONS = ("fp32", "bf16", "fp16")
ZERO_LEVELS = (0, 1, 2, 3)
ZERO_RESHARDS = ("auto", "step", "micro-batch")
"""0: nothing sharded; 1: fp32 masters and optimizer state; 2: and the fp32 gradients;
3: and the weights (FSDP2)."""
"""fp32, or bf16 / fp16 autocast over fp32 master weights and gradients."""


LOSS_SCALE_FIELDS = (
    "loss_scale",
    "initial_scale_power",
    "loss_scale_window",
    "hysteresis",
    "consecutive_hysteresis",
    "min_loss_scale",
)
"""The fp16 loss-scale settings (DeepSpeed's fp16 keys of the same names): fp16 only."""


def recompute_groups(num_layers: int, policy: str) -> list[tuple[range, bool]]:
    """Split a stage's layers into runs, each marked whether to recompute it in backward.

    `none`: one run, kept. `full`: one run, recomputed (only the stage input stays in flight).
    `every:N`: runs of N layers, each recomputed (its input stays in flight).
    """
    if policy == "none":
        return [(range(num_layers), False)]
    if policy == "full":
        return [(range(num_layers), True)]
    if policy.startswith("every:"):
        try:
            size = int(policy.split(":", 1)[1])
        except ValueError:
            size = 0
        if size >= 1:
            return [(range(k, min(k + size, num_layers)), True) for k in range(0, num_layers, size)]
    raise ValueError(f"unknown recompute policy {policy!r}: use none, full or every:N with N >= 1")


def parse_stages(text: str | tuple[int, ...]) -> tuple[int, ...]:
    """Stage numbers from their flat form, `0,2`."""
    if isinstance(text, tuple):
        return text
    try:
        return tuple(int(part) for part in str(text).split(","))
    except ValueError:
        raise ValueError(
            f"cannot read stages {text!r}: give comma-separated stage numbers such as 0,1"
        ) from None


def check_zero_optimizer(zero: int, impl: str, world_size: int | None = None) -> None:
    """What a ZeRO level can run with (a ValueError naming the fix): ZeRO-3's DTensor shards
    need a per-tensor optimizer and torch.distributed (more than one rank)."""
    require(
        zero != 3 or world_size is None or world_size > 1,
        "--zero 3 shards every layer with FSDP2 over torch.distributed, and a run of one rank "
        "has none: use --zero 0, 1 or 2 in one process, or more ranks (--dp 2)",
    )
    require(
        zero != 3 or impl == "per_tensor",
        f"--zero 3 keeps every parameter as an FSDP2 shard (a DTensor), which the "
        f"{impl!r} optimizer implementation cannot step: add --optimizer-impl per_tensor, or "
        "use --zero 1 or 2",
    )


def check_tp_optimizer(tp: int, zero: int, name: str, impl: str) -> None:
    """What a tensor-parallel stage's optimizer can step (a ValueError naming the fix): its
    parameters are DTensor shards, except under ZeRO-1/2, whose flat buffers are plain."""
    if tp == 1 or zero in (1, 2):
        return
    require(
        impl != "deepspeed_cpu",
        f"--tp {tp} with --optimizer-impl deepspeed_cpu: DeepSpeed's CPU Adam "
        "updates plain tensors, not the DTensor shards of a tensor-parallel stage; use "
        "--optimizer-impl fused or per_tensor, --zero 1 or 2 (flat buffers), or --tp 1",
    )
    require(
        not (name == "sgd" and impl == "fused"),
        f"--tp {tp} with --optimizer sgd --optimizer-impl fused: torch's fused "
        "SGD kernel cannot update DTensor shards; use --optimizer-impl per_tensor (or "
        "adamw, whose fused kernel can), --zero 1 or 2 (flat buffers), or --tp 1",
    )


def _stages_text(stages: tuple[int, ...]) -> str:
    return ",".join(map(str, stages))


@dataclass(frozen=True, kw_only=True)
class EngineOptions:
    """How each step computes. Recomputation and ZeRO leave the numbers as they are (up to the
    order of the data-parallel sum);
    precision, clipping and the guard's skipped steps change them, as they would in one process."""

    precision: str = "fp32"
    """fp32, bf16 (autocast, fp32 master weights and grads) or fp16 (plus loss scaling)."""
    clip_grad_norm: float = 0.0
    """Clip the global gradient norm to this value (0 disables clipping)."""
    loss_scale: float = 0.0
    """fp16: a static loss scale; 0 scales dynamically (DeepSpeed's fp16.loss_scale)."""
    initial_scale_power: int = 16
    """fp16: the dynamic loss scale starts at 2 to this power."""
    loss_scale_window: int = 2000
    """fp16: the dynamic loss scale doubles after this many steps without an overflow (counted
    as DeepSpeed counts them, from the step after the last overflow)."""
    hysteresis: int = 1
    """fp16: overflows absorbed (steps skipped, scale kept) before the scale halves; refilled
    when the scale grows. DeepSpeed's ZeRO optimizers default to 2."""
    consecutive_hysteresis: bool = False
    """fp16: refill the hysteresis after every step without an overflow."""
    min_loss_scale: float = 1.0
    """fp16: the dynamic loss scale never halves below this."""
    recompute: str = "none"
    """Activation recomputation per stage: none, full or every:N layers."""
    recompute_stages: tuple[int, ...] | None = field(
        default=None, metadata=flat(parse=parse_stages, text=_stages_text)
    )
    """Stages the recompute policy applies to (comma-separated, such as 0,1); all by default."""
    zero: int = 0
    """What each stage shards over its data-parallel replicas. 0: nothing (fp32 weights,
    gradients all-reduced). 1: the fp32 master weights and optimizer state (each replica steps
    its 1/dp shard); under bf16/fp16 the Linear weights are kept only in the compute dtype,
    their gradients accumulate in fp32 buffers that are all-reduced, and the updated weights
    are all-gathered after the step. 2: as 1, and the gradients are reduce-scattered: each
    replica keeps only its shard's fp32 gradient between steps. 3: everything (torch FSDP2,
    one unit per layer): each replica keeps 1/dp of the fp32 weights, gradients and optimizer
    state, and a layer is gathered in the compute dtype once per step."""
    zero_reshard: str = "auto"
    """ZeRO-3: when a layer gives its gathered weights back. auto (the default): chosen by the
    memory model before the ranks start, per pipeline rank: step where the rank's predicted
    peak fits --device-memory or no budget is given, else micro-batch on its stages where that
    lowers the peak and the schedule allows it (a split backward does not: it stays step); the
    engine used as a library, with no budget, runs step. step: gathered at the step's first
    forward and kept for every micro-batch, gradients accumulated unsharded in fp32 and
    reduce-scattered once after the stage's last backward (the least communication; the stage's
    gathered weights and whole fp32 gradients live over the step). micro-batch: gathered for each
    forward and backward and resharded after each, gradients reduce-scattered after every
    micro-batch's backward into the fp32 shard, as DeepSpeed's ZeRO-3 runs (1/dp of the
    gradients and a layer or two gathered at a time, for a gather per forward and backward and a
    reduce-scatter per micro-batch). Not with a split backward (zb_* schedules)."""
    zero_reshard_stages: tuple[int, ...] | None = field(
        default=None, metadata=flat(parse=parse_stages, text=_stages_text)
    )
    """ZeRO-3: the stages --zero-reshard micro-batch applies to (comma-separated, such as 0,1);
    all by default, and the others keep their layers gathered for the step. `auto` fills it in
    with the stages of the pipeline ranks whose predicted peak does not fit --device-memory."""
    sequence_parallel: bool = False
    """With --tp > 1: run norms, position embeddings and the residual stream between the
    attention and MLP blocks on 1/tp of the sequence per tp rank (Megatron's and torch's
    sequence parallelism): the all-reduce after each row-wise layer becomes a reduce-scatter
    along the sequence and the column-wise layers all-gather their input, so the activations
    between blocks, and those sent between stages, are held 1/tp per rank. The sequence length
    must be a multiple of tp."""
    compile: bool = False
    """torch.compile each layer (regional compilation: one graph per layer class, reused by
    every block): fuses the norms, rotary and activations eager runs as separate kernels;
    agrees with eager to rounding, not bit for bit. Not with a split backward (zb_* schedules):
    a compiled layer hides the Linears whose weight gradients W defers."""
    nonfinite_guard: bool = field(default=True, metadata=flat("no_nonfinite_guard", negate=True))
    """Skip a step whose loss or gradients are not finite on every rank together (the flag
    --no-nonfinite-guard turns it off). Costs one blocking all-reduce per step when neither
    clipping nor fp16 needs one anyway: the next step's warm-up then cannot overlap this step's
    drain ((P-1) forwards of bubble per step)."""

    def __post_init__(self) -> None:
        require(
            self.precision in PRECISIONS,
            f"unknown precision {self.precision!r}: choose one of {', '.join(PRECISIONS)}",
        )
        require(
            self.clip_grad_norm >= 0,
            f"clip_grad_norm={self.clip_grad_norm} must be >= 0 (0 disables)",
        )
        self._check_loss_scaling()
        recompute_groups(1, self.recompute)
        if self.recompute_stages is not None and self.recompute == "none":
            stages = _stages_text(self.recompute_stages)
            raise ValueError(
                f"--recompute-stages {stages} has nothing to apply: --recompute is none; add "
                "--recompute full (or every:N), or drop --recompute-stages"
            )
        require(
            self.zero in ZERO_LEVELS,
            f"zero={self.zero}: choose a ZeRO level among "
            f"{', '.join(map(str, ZERO_LEVELS))} (see --zero's help for what each shards)",
        )
        require(
            self.zero_reshard in ZERO_RESHARDS,
            f"zero_reshard={self.zero_reshard!r}: choose {', '.join(ZERO_RESHARDS[:-1])} or "
            f"{ZERO_RESHARDS[-1]}",
        )
        require(
            self.zero_reshard in ("auto", "step") or self.zero == 3,
            f"--zero-reshard {self.zero_reshard} applies to ZeRO-3's gathered layers, but "
            f"--zero is {self.zero}: add --zero 3 or drop --zero-reshard",
        )
        if self.zero_reshard_stages is not None and self.zero_reshard != "micro-batch":
            stages = _stages_text(self.zero_reshard_stages)
            raise ValueError(
                f"--zero-reshard-stages {stages} names the stages resharded per micro-batch, but "
                f"--zero-reshard is {self.zero_reshard}: add --zero 3 --zero-reshard micro-batch, "
                "or drop --zero-reshard-stages"
            )

    def _check_loss_scaling(self) -> None:
        require(
            0 <= self.loss_scale < math.inf,
            f"loss_scale={self.loss_scale}: give 0 (dynamic) or a positive static scale",
        )
        require(
            0 <= self.initial_scale_power <= 64,
            f"initial_scale_power={self.initial_scale_power}: give a power of two between 0 and "
            "64 (16 starts at 65536)",
        )
        for name in ("loss_scale_window", "hysteresis"):
            value = getattr(self, name)
            require(value >= 1, f"{name}={value} must be at least 1")
        require(self.min_loss_scale > 0, f"min_loss_scale={self.min_loss_scale} must be > 0")
        if self.precision == "fp16":
            return
        defaults = {f.name: f.default for f in fields(self)}
        changed = [n for n in LOSS_SCALE_FIELDS if getattr(self, n) != defaults[n]]
        require(
            not changed,
            f"{', '.join('--' + n.replace('_', '-') for n in changed)} only apply to "
            f"--precision fp16 (this run is {self.precision}, which scales no loss): drop them "
            "or use --precision fp16",
        )

    def reshard_of(self, stage: int) -> str:
        """When `stage`'s gathered layers go back under ZeRO-3: `micro-batch` or `step` (which
        an unresolved `auto` runs, as the engine used as a library with no budget does)."""
        chosen = self.zero_reshard_stages is None or stage in self.zero_reshard_stages
        return "micro-batch" if self.zero_reshard == "micro-batch" and chosen else "step"

    def recompute_of(self, stage: int) -> str:
        """The recompute policy `stage` runs."""
        chosen = self.recompute_stages is None or stage in self.recompute_stages
        return self.recompute if chosen else "none"
