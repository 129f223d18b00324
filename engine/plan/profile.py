"""Measured per-stage costs for the simulator: time F, B, I and W of the real stages.

Each stage is built alone (only its layers), run on sample input for a few micro-batches, and
timed per action; the medians become `ActionCosts.per_stage`, so a prediction reflects the
partition's real imbalance.

One stage is built at a time, once: its fused backward (F, B) is timed first, then the same
stage turns on the split backward and times I and W. Before anything is built, each stage's
memory (fp32 weights and gradients plus an activation allowance) is checked against what the
machine has available, so a layout too large for this host fails with the fixes instead of
being killed by the kernel.

Every timing here runs with freed host memory kept (`keep_freed_host_memory`), as the engine
computes on the CPU: with glibc's defaults, timing one layer at a time handed each activation
back to the kernel and faulted it in again on the next run (a layer profile up to 25 % slower
than the same layers in a GPipe step, docs/BENCHMARKS.md), which the engine's steps no longer
pay.
"""

from __future__ import annotations

import gc
import os
import statistics
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path

import torch
from torch.distributed.device_mesh import DeviceMesh

from engine.config import require
from engine.config.sizes import format_size
from engine.memory.fake_world import stage_grid
from engine.memory.states import stage_params
from engine.parallel.tensor_parallel import build_sharded_layers, sharded_loss_scope
from engine.plan.hardware import STEP_BYTES_PER_PARAMETER
from engine.runtime.clipping import clip_gradients, global_grad_norm
from engine.runtime.host_memory import keep_freed_host_memory
from engine.runtime.precision import compute_dtype
from engine.runtime.stage import PipelineStage
from engine.schedule.simulate import ActionCosts
from models import LayerSpec
from partitioners import Partition
from partitioners.costs import (
    activation_costs,
    backward_root,
    measured_costs,
    median_seconds,
    synchronized,
)

__all__ = [
    "available_cores",
    "available_memory",
    "measured_device_flops",
    "measured_forward",
    "measured_input_shares",
    "measured_memory_bandwidth",
    "measured_split_forward",
    "profile_stage_costs",
    "stage_profile_bytes",
]

_MEMINFO = Path("/proc/meminfo")


def available_cores() -> int:
    """CPU cores this process may run on: what a CPU run's ranks on this host share."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def available_memory() -> int | None:
    """Bytes the kernel says can be allocated without swapping (`MemAvailable`), or None
    where it cannot be read (not Linux, no /proc)."""
    try:
        lines = _MEMINFO.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        name, _, value = line.partition(":")
        if name == "MemAvailable":
            number, _, unit = value.strip().partition(" ")
            return int(number) * (1024 if unit.strip().lower() == "kb" else 1)
    return None


def _output_bytes(spec: LayerSpec, batch_size: int, seq_len: int) -> int:
    """Bytes of the layer's output for one micro-batch, traced on `meta`."""
    out = spec.build("meta")(spec.example_input(batch_size, seq_len))
    return int(out.numel() * 4)


def stage_profile_bytes(
    specs: Sequence[LayerSpec], layers: range, *, batch_size: int, seq_len: int
) -> int:
    """A rough estimate of the bytes profiling one stage adds to this process: fp32 weights
    and gradients, the largest weight once more (initialisation draws each on the CPU before
    copying it in), twice what the layers save for the backward (its transients are about as
    large) and three copies of the stage's output (on the last stage the logits, their
    log-softmax and their gradient)."""
    stage_specs = [specs[i] for i in layers]
    params = [p.numel for p in stage_params(stage_specs)]
    states = 4 * (2 * sum(params) + max(params, default=0))
    saved = sum(activation_costs(stage_specs, batch_size=batch_size, seq_len=seq_len))
    return states + 2 * saved + 3 * _output_bytes(stage_specs[-1], batch_size, seq_len)


def _check_fits(
    specs: Sequence[LayerSpec], partition: Partition, batch_size: int, seq_len: int
) -> None:
    """Refuse before building anything when the largest stage cannot fit in this host's
    available memory (skipped where that cannot be read)."""
    available = available_memory()
    if available is None:
        return
    needs = [
        stage_profile_bytes(specs, partition.layers_of(s), batch_size=batch_size, seq_len=seq_len)
        for s in range(partition.num_stages)
    ]
    stage = max(range(len(needs)), key=needs.__getitem__)
    if needs[stage] <= available:
        return
    layers = partition.layers_of(stage)
    raise ValueError(
        f"profiling stage {stage} (layers [{layers.start}, {layers.stop})) needs about "
        f"{format_size(needs[stage])} (fp32 weights and gradients plus activations for "
        f"micro-batches of {batch_size} × {seq_len} tokens) but this machine has "
        f"{format_size(available)} available: "
        "use more stages (--pp), a smaller --seq-len or --micro-batch-size, or give the "
        "costs explicitly (--costs F,B,I,W)"
    )


def _time_actions(actions: Sequence[Callable[[int], object]], repeats: int) -> list[float]:
    """Median seconds of each action over `repeats` micro-batches, after one warm-up
    micro-batch (excluded: first-touch allocations, lazy kernel setup)."""
    samples: list[list[float]] = [[] for _ in actions]
    for k in range(repeats + 1):
        for action, bucket in zip(actions, samples, strict=True):
            start = time.perf_counter()
            action(k)
            if k:
                bucket.append(time.perf_counter() - start)
    return [statistics.median(bucket) for bucket in samples]


def _profile_stage(
    specs: Sequence[LayerSpec],
    stage_index: int,
    partition: Partition,
    batch_size: int,
    seq_len: int,
    repeats: int,
) -> tuple[float, float, float, float]:
    """F and B with the fused backward, then I and W of the same stage with the split one.

    `enable_split_backward` only adds forward hooks, so the fused micro-batches before it
    are untouched, and the ones after it record their Linears for a real I/W split.
    """
    layers = partition.layers_of(stage_index)
    stage = PipelineStage(
        specs, stage=stage_index, layers=layers, num_stages=partition.num_stages, seed=0
    )
    first = specs[layers.start]
    tokens = torch.randint(0, 256, (batch_size, seq_len))
    shape = first.example_input(batch_size, seq_len).shape
    grads: dict[int, tuple[torch.Tensor, ...]] = {}
    inputs: list[torch.Tensor] = []

    def forward(split: bool, k: int) -> None:
        x = (tokens,) if first.input_kind == "tokens" else (inputs[k],)
        out = stage.forward(k, x, targets=tokens, split=split)
        grads[k] = () if stage.is_last else tuple(torch.ones_like(o) for o in out)

    inputs[:] = [torch.randn(shape).requires_grad_() for _ in range(repeats + 1)]
    f, b = _time_actions(
        [partial(forward, False), lambda k: stage.backward(k, grads.pop(k))], repeats
    )
    stage.enable_split_backward()
    inputs[:] = [torch.randn(shape).requires_grad_() for _ in range(repeats + 1)]
    _, i, w = _time_actions(
        [
            partial(forward, True),
            lambda k: stage.backward_input(k, grads.pop(k)),
            stage.backward_weight,
        ],
        repeats,
    )
    return f, b, i, w


def profile_stage_costs(
    specs: Sequence[LayerSpec],
    partition: Partition,
    *,
    batch_size: int = 1,
    seq_len: int = 128,
    repeats: int = 3,
    comm: float = 0.0,
) -> ActionCosts:
    """Median seconds of F, B, I, W per stage (after a warm-up micro-batch) on this CPU.

    Stages are built one at a time, each freed before the next. Raises ValueError, before
    building any stage, when a stage would not fit in this machine's available memory.
    """
    if repeats < 1:
        raise ValueError(f"repeats={repeats} must be at least 1")
    _check_fits(specs, partition, batch_size, seq_len)
    keep_freed_host_memory()
    per_stage = []
    for s in range(partition.num_stages):
        per_stage.append(_profile_stage(specs, s, partition, batch_size, seq_len, repeats))
        # A stage with split backward holds itself through its forward hooks (and the
        # timing closures through it): a reference cycle that only the collector frees, so
        # without this the next stage would be built beside this one.
        gc.collect()
    return ActionCosts(per_stage=tuple(per_stage), comm=comm)


def measured_forward(
    specs: Sequence[LayerSpec],
    micro_batch_size: int,
    seq_len: int,
    repeats: int = 3,
    device: str = "cpu",
) -> tuple[float, ...]:
    """Each layer's forward seconds on this CPU (or `device`) for one micro-batch: a third of
    its measured forward plus backward (`partitioners.measured_costs`, the median of
    `repeats`), as the simulator's costs split it."""
    keep_freed_host_memory()
    costs = measured_costs(
        specs, batch_size=micro_batch_size, seq_len=seq_len, repeats=repeats, device=device
    )
    return tuple(t / 3 for t in costs)


def measured_input_shares(
    specs: Sequence[LayerSpec], micro_batch_size: int, seq_len: int, repeats: int = 3
) -> tuple[float, ...]:
    """Of each layer's backward on this CPU, the share the split backward runs at I: I over
    I + W, each distinct layer timed once as a stage of its own (`_profile_stage`). On a CPU
    a block's norms, activations and softmax backward, all at I, weigh more than their FLOPs
    (gpt-bench's blocks at micro-batches of 2 × 128 tokens: 0.57, where FLOPs say 0.52)."""
    require(repeats >= 1, f"repeats={repeats} must be at least 1")
    alone = Partition(boundaries=tuple(range(len(specs) + 1)))
    _check_fits(specs, alone, micro_batch_size, seq_len)
    keep_freed_host_memory()
    shares: dict[LayerSpec, float] = {}
    for index, spec in enumerate(specs):
        if spec not in shares:
            _, _, i, w = _profile_stage(specs, index, alone, micro_batch_size, seq_len, repeats)
            shares[spec] = i / (i + w) if i + w > 0 else 1.0
            gc.collect()  # the stage's forward hooks hold it in a cycle (`profile_stage_costs`)
    return tuple(shares[spec] for spec in specs)


def measured_memory_bandwidth(
    specs: Sequence[LayerSpec] = (), repeats: int = 5, device: str = "cpu"
) -> float:
    """Bytes/s the optimizer phase moves on this CPU (or `device`), counted as
    `Hardware.update_time` counts them: the engine's gradient norm and clipping
    (`engine.runtime.clipping`), then torch's fused AdamW (meshpipe's default), over the
    model's parameters in their order (the first `_SAMPLED_PARAMETERS`; one flat tensor of as
    many without `specs`), the median of `repeats` steps after a warm-up one. Each tensor
    costs Python calls and kernel launches beside its bytes: the phase over gpt-bench's 132
    tensors took 10.4 ms, where AdamW alone over one flat tensor of as many parameters had
    priced it at 4.5 ms (docs/BENCHMARKS.md)."""
    require(repeats >= 1, f"repeats={repeats}")
    sizes = _sampled_sizes(specs)
    weights = [torch.nn.Parameter(torch.zeros(n, device=device)) for n in sizes]
    for weight in weights:
        weight.grad = torch.full_like(weight, 1e-3)
    named = [(str(i), weight) for i, weight in enumerate(weights)]
    order = {name: i for i, (name, _) in enumerate(named)}
    optimizer = torch.optim.AdamW(weights, fused=True)

    def step() -> None:
        clip_gradients(weights, global_grad_norm(named, order), 1.0)
        optimizer.step()

    seconds = median_seconds(synchronized(step, device), repeats)
    return STEP_BYTES_PER_PARAMETER * sum(sizes) / seconds


_SAMPLED_PARAMETERS = 4 * 2**20
"""Parameters the optimizer phase is timed over: enough for its rate, few enough to time
in a fraction of a second for any model."""


def _sampled_sizes(specs: Sequence[LayerSpec]) -> list[int]:
    """The model's parameters' sizes in order, up to `_SAMPLED_PARAMETERS` in all (the last
    one cut short where it would pass them)."""
    sizes: list[int] = []
    left = _SAMPLED_PARAMETERS
    for info in stage_params(specs) if specs else []:
        if left == 0:
            break
        sizes.append(min(info.numel, left))
        left -= sizes[-1]
    return sizes or [_SAMPLED_PARAMETERS]


def measured_device_flops(precision: str, largest: int = 1024, repeats: int = 5) -> float:
    """FLOP/s of a square matrix product in the precision's compute dtype on this CPU (the
    median of `repeats` after a warm-up): with `--profile` the layers are timed here, so the
    MFU a plan reports is against what this host's GEMMs reach, not an H100's peak. The side
    doubles from 128 until a product takes `_LONG_ENOUGH` or the side reaches `largest`: a
    large GEMM's rate where the dtype is fast, and no minute of products where it is not
    (fp16 on a CPU without its kernels: about 1 GFLOP/s)."""
    require(repeats >= 1 and largest >= 1, f"repeats={repeats}, largest={largest}")
    keep_freed_host_memory()
    dtype, size = compute_dtype(precision), min(128, largest)
    while True:
        a, b = (torch.randn(size, size).to(dtype) for _ in range(2))
        seconds = median_seconds(partial(torch.matmul, a, b), repeats)
        if seconds >= _LONG_ENOUGH or size >= largest:
            return 2 * size**3 / seconds
        size = min(2 * size, largest)


_LONG_ENOUGH = 0.01
"""Seconds one timed matrix product should last for its rate to be a large GEMM's."""


def measured_split_forward(
    specs: Sequence[LayerSpec], micro_batch_size: int, seq_len: int, tp: int, repeats: int = 3
) -> tuple[float, ...]:
    """Each layer's forward seconds on this CPU split `tp` ways, as the engine splits it
    (DTensor, `parallelize_module`), on a fake world of `tp` ranks: its collectives return at
    once, so this is one rank's compute and DTensor's own work, without the transfers (the
    cost model adds those from the link). A third of forward plus backward, as
    `measured_forward`. Why not the unsplit time over `tp`: on a CPU, DTensor's dispatch
    costs about as much as the half of the GEMMs it saves at small sizes."""
    if repeats < 1 or tp < 2:
        raise ValueError(f"repeats={repeats} and tp={tp}: give at least 1 and 2")
    keep_freed_host_memory()
    with stage_grid(1, tp) as grid:
        assert grid.tp_mesh is not None
        return tuple(
            _time_split_layer(specs, i, micro_batch_size, seq_len, grid.tp_mesh, repeats) / 3
            for i in range(len(specs))
        )


def _time_split_layer(
    specs: Sequence[LayerSpec],
    index: int,
    batch_size: int,
    seq_len: int,
    tp_mesh: DeviceMesh,
    repeats: int,
) -> float:
    """Median seconds of one split layer's forward plus backward, after a warm-up run."""
    spec = specs[index]
    stack = build_sharded_layers(
        specs, range(index, index + 1), seed=0, device="cpu", tp_mesh=tp_mesh
    )
    x = spec.example_input(batch_size, seq_len, device="cpu")
    if x.is_floating_point():
        x = torch.randn(x.shape).requires_grad_()
    last = index == len(specs) - 1
    with sharded_loss_scope(last):
        return median_seconds(lambda: backward_root(stack(x), last).backward(), repeats)
