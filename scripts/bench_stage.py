"""One pipeline stage's forward + backward throughput and model FLOP utilisation on one device.

The stage is the runtime's own `PipelineStage` (fp32 master weights, autocast to the compute
dtype, the split backward when asked), fed what a middle stage receives: hidden states in the
compute dtype that require a gradient, and an output gradient of the same shape. Model FLOPs
are analytic (each layer's `forward_flops`, ×3 for forward + backward; recomputation is not
counted), MFU is achieved FLOP/s over the device's dense peak for the compute dtype.

    python scripts/bench_stage.py --model llama-1b --device cuda --precision bf16 \\
        --micro-batch-size 4 --seq-len 2048
    python scripts/bench_stage.py --model gpt-bench --micro-batch-size 4 --seq-len 128  # CPU
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.comm.mesh import init_mesh
from engine.config import PRECISIONS, EngineOptions
from engine.runtime.engine import PipelineEngine
from engine.runtime.precision import compute_dtype, step_casts
from engine.runtime.stage import PipelineStage
from engine.runtime.step_clock import StepClock, step_clock
from models import MODEL_CONFIGS, LayerSpec, layer_specs
from partitioners import Partition

# Dense (no sparsity) peak TFLOP/s per compute dtype, from the vendors' data sheets; the first
# entry whose name occurs in the device's name wins ("NVIDIA H100 80GB HBM3" is the SXM part).
# fp32 is the CUDA cores' figure: torch runs fp32 matmuls without TF32 unless told to.
CASTS = ("step", "autocast-step", "micro-batch")

PEAK_TFLOPS = (
    ("H100 PCIe", {"bf16": 756.0, "fp16": 756.0, "fp32": 51.2}),
    ("H100 NVL", {"bf16": 835.0, "fp16": 835.0, "fp32": 60.0}),
    ("H100", {"bf16": 989.4, "fp16": 989.4, "fp32": 66.9}),
    ("H200", {"bf16": 989.4, "fp16": 989.4, "fp32": 66.9}),
    ("A100", {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5}),
)


@dataclass(frozen=True)
class StageResult:
    """What one stage sustained: per micro-batch times, throughput, MFU and memory."""

    model: str
    layers: str
    params: int
    device: str
    precision: str
    micro_batch_size: int
    seq_len: int
    micro_batches: int
    """Micro-batches per step: they share the step's low-precision weight casts."""
    casts: str
    """`step` (the engine's step scope: one low-precision copy of each Linear weight per
    step, its gradients added into the fp32 master), `autocast-step` (autocast's cache kept
    over the step: the same casts, gradients widened before the add) or `micro-batch`
    (autocast's own: one cast per weight and micro-batch), to measure what each buys."""
    split: bool
    compiled: bool
    compile_mode: str | None
    """torch.compile's `mode` (None: its default)."""
    forward_ms: float
    backward_ms: float
    tokens_per_s: float
    tflops: float
    mfu: float | None
    peak_memory_gib: float | None


def peak_tflops(device: torch.device, precision: str) -> float | None:
    """The device's dense peak for `precision`, or None where it is not known (CPUs)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peaks[precision] for key, peaks in PEAK_TFLOPS if key in name), None)


def stage_layers(specs: Sequence[LayerSpec], text: str) -> range:
    """`blocks` (every block: what a middle stage holds), `all`, or a slice `a:b`."""
    if text == "blocks":
        blocks = [i for i, spec in enumerate(specs) if spec.name == "block"]
        return range(blocks[0], blocks[-1] + 1)
    if text == "all":
        return range(len(specs))
    start, colon, stop = text.partition(":")
    try:
        bounds = slice(int(start) if start else None, int(stop) if stop else None)
        chosen = range(len(specs))[bounds] if colon else range(0)
    except ValueError:
        chosen = range(0)
    if not chosen:
        raise ValueError(
            f"--layers {text} is not a contiguous, non-empty run of the {len(specs)} layers: "
            f"give blocks, all, or a:b with 0 <= a < b <= {len(specs)}"
        )
    return chosen


def _medians(
    clock: StepClock, marks: list[tuple[int, int, int]], group: int = 1
) -> tuple[float, float]:
    """Median seconds of the two spans (start → middle, middle → end) over `marks`, on the
    device's clock (CUDA events on a GPU: kernels run after the host queues them); with
    `group`, each sample is the mean over `group` consecutive marks (one step's micro-batches).
    """
    times = clock.seconds()
    first = [times[middle] - times[start] for start, middle, _ in marks]
    second = [times[end] - times[middle] for _, middle, end in marks]
    steps = range(0, len(marks), group)
    first = [statistics.fmean(first[i : i + group]) for i in steps]
    second = [statistics.fmean(second[i : i + group]) for i in steps]
    return statistics.median(first), statistics.median(second)


def measure_stage(
    model: str,
    *,
    layers: str = "blocks",
    device: str = "cpu",
    precision: str = "fp32",
    micro_batch_size: int = 4,
    seq_len: int = 128,
    steps: int = 10,
    warmup: int = 2,
    micro_batches: int = 1,
    casts: str = "step",
    split: bool = False,
    compile: bool = False,
    compile_mode: str | None = None,
    peak: float | None = None,
) -> StageResult:
    """Forward and backward time of one micro-batch through a stage of `model`: the median
    over `steps` steps of each step's mean over its `micro_batches` micro-batches (which share
    the step's weight casts, as in the engine); MFU against `peak` TFLOP/s, or the device's
    known peak when not given."""
    if casts not in CASTS:
        raise ValueError(f"casts={casts!r}: choose one of {', '.join(CASTS)}")
    specs = layer_specs(MODEL_CONFIGS[model])
    chosen = stage_layers(specs, layers)
    target = torch.device(device)
    index = 0 if chosen.start == 0 else 1  # a stage knows first and last by its index
    stage = PipelineStage(
        specs,
        stage=index,
        layers=chosen,
        num_stages=index + (1 if chosen.stop == len(specs) else 2),
        seed=0,
        device=target,
        precision=precision,
        compile=compile,
    )
    if split:
        stage.enable_split_backward()
    if compile and compile_mode is not None:
        for module in stage.module.layers.values():
            module.compile(mode=compile_mode)  # replaces the stage's default compilation
    first = specs[chosen.start]
    tokens = torch.randint(0, first.config.vocab_size, (micro_batch_size, seq_len), device=target)
    if first.input_kind == "tokens":
        sample = tokens
    else:
        shape = (micro_batch_size, seq_len, first.config.d_model)
        sample = torch.randn(shape, device=target, dtype=compute_dtype(precision))
    if target.type == "cuda":
        torch.cuda.reset_peak_memory_stats(target)
    forward, backward = _time_stage(
        stage,
        sample,
        tokens,
        casts=casts,
        split=split,
        steps=steps,
        warmup=warmup,
        micro_batches=micro_batches,
    )
    flops = 3 * sum(specs[i].forward_flops(micro_batch_size, seq_len) for i in chosen)
    achieved = flops / (forward + backward)
    peak = peak or peak_tflops(target, precision)
    return StageResult(
        model=model,
        layers=f"{chosen.start}:{chosen.stop}",
        params=sum(p.numel() for p in stage.module.parameters()),
        device=torch.cuda.get_device_name(target) if target.type == "cuda" else "cpu",
        precision=precision,
        micro_batch_size=micro_batch_size,
        seq_len=seq_len,
        micro_batches=micro_batches,
        casts=casts,
        split=split,
        compiled=compile,
        compile_mode=compile_mode if compile else None,
        forward_ms=forward * 1e3,
        backward_ms=backward * 1e3,
        tokens_per_s=micro_batch_size * seq_len / (forward + backward),
        tflops=achieved / 1e12,
        mfu=achieved / (peak * 1e12) if peak else None,
        peak_memory_gib=(
            torch.cuda.max_memory_allocated(target) / 2**30 if target.type == "cuda" else None
        ),
    )


def _time_stage(
    stage: PipelineStage,
    sample: torch.Tensor,
    tokens: torch.Tensor,
    *,
    casts: str,
    split: bool,
    steps: int,
    warmup: int,
    micro_batches: int,
) -> tuple[float, float]:
    """Median forward and backward seconds of one micro-batch (`_medians`), the step's
    micro-batches sharing its weight casts as `casts` says."""
    tokens_in = not sample.is_floating_point()
    clock = step_clock(stage.device)
    marks = []
    for step in range(warmup + steps):
        with _cast_scope(stage, casts):
            for k in range(micro_batches):
                x = sample if tokens_in else sample.detach().requires_grad_()
                start = clock.mark()
                out = stage.forward(k, (x,), targets=tokens if stage.is_last else None)
                middle = clock.mark()
                grads = () if stage.is_last else tuple(torch.ones_like(o) for o in out)
                if split:
                    stage.backward_input(k, grads)
                    stage.backward_weight(k)
                else:
                    stage.backward(k, grads)
                if step >= warmup:
                    marks.append((start, middle, clock.mark()))
    return _medians(clock, marks, micro_batches)


def _cast_scope(stage: PipelineStage, casts: str) -> contextlib.AbstractContextManager[None]:
    """One step's weight casts: the engine's copies, autocast's cache kept over the step, or
    (micro-batch) autocast's own per forward."""
    if casts == "step":
        return stage.step_scope()
    if casts == "autocast-step":
        return step_casts(stage.precision, stage.device)
    return contextlib.nullcontext()


@dataclass(frozen=True)
class RuntimeOverhead:
    """What the engine adds to a bare stage per micro-batch (one rank, the whole model as one
    stage, 1F1B, no optimizer): the interpreter, the stash, the loss and the step's reports."""

    micro_batches: int
    bare_ms: float
    """Forward + backward of one micro-batch through the bare `PipelineStage`."""
    engine_ms: float
    """`train_step` ÷ micro-batches."""

    @property
    def overhead_ms(self) -> float:
        return self.engine_ms - self.bare_ms


def measure_runtime_overhead(
    model: str,
    *,
    device: str = "cpu",
    precision: str = "fp32",
    micro_batch_size: int = 4,
    seq_len: int = 128,
    micro_batches: int = 8,
    steps: int = 5,
    warmup: int = 1,
    compile: bool = False,
) -> RuntimeOverhead:
    """Engine steps and bare micro-batch loops, alternated so both see the same machine."""
    specs = layer_specs(MODEL_CONFIGS[model])
    mesh = init_mesh(1, 1, backend="gloo" if torch.device(device).type == "cpu" else None)
    if mesh.device.type != torch.device(device).type:
        raise ValueError(f"--device {device} is not available here (the engine got {mesh.device})")
    engine = PipelineEngine(
        specs,
        mesh,
        partition=Partition(boundaries=(0, len(specs))),
        micro_batches=micro_batches,
        options=EngineOptions(precision=precision, compile=compile),
    )
    bare = PipelineStage(
        specs, stage=0, layers=range(len(specs)), num_stages=1, seed=0, device=mesh.device,
        precision=precision, compile=compile,
    )  # fmt: skip
    vocab = specs[0].config.vocab_size
    tokens = torch.randint(0, vocab, (micro_batch_size * micro_batches, seq_len + 1))
    inputs, targets = tokens[:, :-1].to(mesh.device), tokens[:, 1:].to(mesh.device)
    clock = step_clock(mesh.device)
    marks = []
    for step in range(warmup + steps):
        start = clock.mark()
        engine.train_step(inputs, targets)
        middle = clock.mark()
        for param in bare.module.parameters():
            param.grad = None  # as the engine starts a step
        with bare.step_scope():  # the engine's step shares its weight copies too
            for k, (x, y) in enumerate(
                zip(inputs.split(micro_batch_size), targets.split(micro_batch_size), strict=True)
            ):
                bare.forward(k, (x,), targets=y, loss_divisor=micro_batches)
                bare.backward(k)
        if step >= warmup:
            marks.append((start, middle, clock.mark()))
    engine_s, bare_s = _medians(clock, marks)
    return RuntimeOverhead(
        micro_batches=micro_batches,
        bare_ms=bare_s / micro_batches * 1e3,
        engine_ms=engine_s / micro_batches * 1e3,
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt-bench", choices=sorted(MODEL_CONFIGS))
    parser.add_argument(
        "--layers", default="blocks", help="'blocks' (every block), 'all', or a slice 'a:b'"
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--precision", default="fp32", choices=PRECISIONS)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=10, help="measured steps")
    parser.add_argument(
        "--micro-batches",
        type=int,
        default=1,
        help="micro-batches per step (they share the step's low-precision weight casts)",
    )
    parser.add_argument(
        "--casts",
        default="step",
        choices=CASTS,
        help="step: the engine's (one low-precision copy per Linear weight and step, gradients "
        "added into the fp32 masters); autocast-step: autocast's cache kept over the step; "
        "micro-batch: autocast's own casts",
    )
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--split", action="store_true", help="I + W instead of a fused B")
    parser.add_argument(
        "--compile", action="store_true", help="torch.compile each layer (not with --split)"
    )
    parser.add_argument(
        "--compile-mode",
        default=None,
        help="torch.compile's mode with --compile (e.g. max-autotune-no-cudagraphs)",
    )
    parser.add_argument(
        "--peak-tflops", type=float, default=None, help="the device's peak (default: known GPUs)"
    )
    parser.add_argument("--threads", type=int, default=None, help="intra-op threads (CPU)")
    parser.add_argument(
        "--runtime-overhead",
        type=int,
        metavar="M",
        default=0,
        help="also time the engine on the whole model (one rank, M micro-batches) against the "
        "bare stage: what the runtime adds per micro-batch",
    )
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    return parser


def main() -> None:
    parser = _parser()
    args = parser.parse_args()
    if args.compile and args.split:
        parser.error("--compile hides the Linears whose weight gradients --split defers: drop one")
    if args.compile_mode is not None and not args.compile:
        parser.error("--compile-mode sets how --compile compiles: add --compile")
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: this machine has no CUDA device; use --device cpu")
    if args.threads:
        torch.set_num_threads(args.threads)
    result = measure_stage(
        args.model,
        layers=args.layers,
        device=args.device,
        precision=args.precision,
        micro_batch_size=args.micro_batch_size,
        seq_len=args.seq_len,
        steps=args.steps,
        warmup=args.warmup,
        micro_batches=args.micro_batches,
        casts=args.casts,
        split=args.split,
        compile=args.compile,
        compile_mode=args.compile_mode,
        peak=args.peak_tflops,
    )
    overhead = None
    if args.runtime_overhead:
        overhead = measure_runtime_overhead(
            args.model,
            device=args.device,
            precision=args.precision,
            micro_batch_size=args.micro_batch_size,
            seq_len=args.seq_len,
            micro_batches=args.runtime_overhead,
            steps=args.steps,
            compile=args.compile,
        )
    if args.json:
        extra = {} if overhead is None else {"runtime": asdict(overhead)}
        print(json.dumps({**asdict(result), **extra}))
        return
    _print_table(result, overhead)


def _print_table(result: StageResult, overhead: RuntimeOverhead | None) -> None:
    """The result as one row of the BENCHMARKS.md table, then the runtime's overhead."""
    mfu = "–" if result.mfu is None else f"{result.mfu:.1%}"
    memory = "–" if result.peak_memory_gib is None else f"{result.peak_memory_gib:.1f}"
    mode = ("compiled" if result.compiled else "eager") + (", I + W" if result.split else "")
    mode += f" ({result.compile_mode})" if result.compile_mode else ""
    mode += {"step": "", "autocast-step": ", autocast's step cache"}.get(
        result.casts, ", casts per micro-batch"
    )
    print("| model | layers | params | device | precision | mode | B × T | µb/step | F ms | B ms "
          "| tokens/s | TFLOP/s | MFU | peak GiB |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    print(
        f"| {result.model} | {result.layers} | {result.params / 1e6:,.1f}M | {result.device} "
        f"| {result.precision} | {mode} | {result.micro_batch_size} × {result.seq_len} "
        f"| {result.micro_batches} | {result.forward_ms:.1f} | {result.backward_ms:.1f} "
        f"| {result.tokens_per_s:,.0f} | {result.tflops:.2f} | {mfu} | {memory} |"
    )
    if overhead is not None:
        print(
            f"\nruntime overhead (whole model as one stage, 1F1B, {overhead.micro_batches} "
            f"micro-batches): engine {overhead.engine_ms:.2f} ms vs bare stage "
            f"{overhead.bare_ms:.2f} ms per micro-batch = {overhead.overhead_ms:+.2f} ms "
            f"({overhead.overhead_ms / overhead.bare_ms:+.1%})"
        )


if __name__ == "__main__":
    main()
