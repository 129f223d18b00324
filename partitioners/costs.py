"""Per-layer costs of a layer list: the input of every partitioner.

Parameters, FLOPs and activation bytes come from the layer specs without allocating memory
(activations are traced on the meta device); measured time profiles each layer for real, one
layer at a time, so even the profile never holds more than one layer.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import torch

from models.layers import LayerSpec
from models.stack import build_layers, lm_loss
from partitioners._checks import check_num_stages
from partitioners.methods import make_partition
from partitioners.partition import Partition

__all__ = [
    "COST_MODELS",
    "activation_costs",
    "backward_root",
    "flop_costs",
    "layer_costs",
    "measured_costs",
    "median_seconds",
    "parameter_costs",
    "synchronized",
]

COST_MODELS = ("parameters", "flops", "activations", "time")


def parameter_costs(specs: Sequence[LayerSpec]) -> tuple[int, ...]:
    """Parameters each layer holds (a tied weight counts on every layer that holds a copy)."""
    return tuple(spec.num_parameters() for spec in specs)


def flop_costs(specs: Sequence[LayerSpec], *, batch_size: int, seq_len: int) -> tuple[int, ...]:
    """Analytic forward FLOPs per layer for one micro-batch (training is about 3x this)."""
    return tuple(spec.forward_flops(batch_size, seq_len) for spec in specs)


def _saved_bytes(spec: LayerSpec, batch_size: int, seq_len: int, dtype: torch.dtype) -> int:
    """Bytes of distinct non-parameter tensors autograd saves in one forward, traced on meta."""
    module = spec.build("meta").to(dtype)
    x = spec.example_input(batch_size, seq_len, device="meta")
    if x.is_floating_point():
        x = x.to(dtype).requires_grad_()
    params = {id(p) for p in module.parameters()}
    saved: dict[int, torch.Tensor] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        base = t if t._base is None else t._base
        if id(base) not in params:
            saved[id(base)] = base
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(x)
    return sum(t.untyped_storage().nbytes() for t in saved.values())


def activation_costs(
    specs: Sequence[LayerSpec],
    *,
    batch_size: int,
    seq_len: int,
    dtype: torch.dtype = torch.float32,
) -> tuple[int, ...]:
    """Bytes each layer keeps alive for its backward, per micro-batch (input included)."""
    return tuple(_saved_bytes(spec, batch_size, seq_len, dtype) for spec in specs)


def backward_root(out: torch.Tensor, last: bool) -> torch.Tensor:
    """What a timed layer's backward starts from. The model's last layer feeds the LM loss,
    as in training: the softmax over the vocabulary and its gradient are the last stage's
    work too, if small against the head's GEMMs. Any other layer's output is summed."""
    if not last:
        return out.float().sum()
    return lm_loss(out, torch.zeros(out.shape[:-1], dtype=torch.long, device=out.device))


def median_seconds(run: Callable[[], object], repeats: int) -> float:
    """Median wall seconds of `repeats` calls of `run`, after one warm-up call."""
    samples = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        run()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples[1:])


def synchronized(run: Callable[[], object], device: str) -> Callable[[], object]:
    """`run`, then a wait for the device's queued kernels where it queues them (CUDA): what a
    wall-clock timing of GPU work must include."""
    if torch.device(device).type != "cuda":
        return run

    def waited() -> None:
        run()
        torch.cuda.synchronize(device)

    return waited


def _time_layer(
    spec: LayerSpec,
    index: int,
    batch_size: int,
    seq_len: int,
    repeats: int,
    last: bool,
    device: str,
) -> float:
    layer = build_layers([spec] * (index + 1), [index], seed=0, device=device)
    x = spec.example_input(batch_size, seq_len, device=device)
    if x.is_floating_point():
        x = torch.randn(x.shape, device=device).requires_grad_()
    step = synchronized(lambda: backward_root(layer(x), last).backward(), device)
    return median_seconds(step, repeats)


def measured_costs(
    specs: Sequence[LayerSpec],
    *,
    batch_size: int,
    seq_len: int,
    repeats: int = 3,
    device: str = "cpu",
) -> tuple[float, ...]:
    """Median seconds of forward + backward per layer on `device` (the CPU, or a GPU, waiting
    for its kernels), after one warm-up run; the last layer's with the loss
    (`backward_root`)."""
    if repeats < 1:
        raise ValueError(f"repeats={repeats} must be at least 1")
    last = len(specs) - 1
    return tuple(
        _time_layer(spec, i, batch_size, seq_len, repeats, i == last, device)
        for i, spec in enumerate(specs)
    )


def layer_costs(
    specs: Sequence[LayerSpec], model: str, *, batch_size: int = 1, seq_len: int = 128
) -> tuple[float, ...]:
    """Costs by the named model: `parameters`, `flops`, `activations` or `time`."""
    if model == "parameters":
        return tuple(float(c) for c in parameter_costs(specs))
    if model == "flops":
        return tuple(float(c) for c in flop_costs(specs, batch_size=batch_size, seq_len=seq_len))
    if model == "activations":
        costs = activation_costs(specs, batch_size=batch_size, seq_len=seq_len)
        return tuple(float(c) for c in costs)
    if model == "time":
        return measured_costs(specs, batch_size=batch_size, seq_len=seq_len)
    raise ValueError(f"unknown cost model {model!r}: choose one of {', '.join(COST_MODELS)}")


def partition_model(
    specs: Sequence[LayerSpec],
    *,
    method: str,
    num_stages: int,
    cost_model: str = "flops",
    batch_size: int = 1,
    seq_len: int = 128,
) -> Partition:
    """Partition a layer list: gather what `method` needs from the specs, then split.

    `balanced` balances the `cost_model` costs; `parameters` and `type:` use parameter counts
    and class names; explicit layouts need nothing.
    """
    check_num_stages(len(specs), num_stages)
    if method.strip().lower() == "memory":
        raise ValueError(
            "partition method 'memory' needs the memory model: resolve it with "
            "engine.memory.fitting_partition (train, memory and plan do)"
        )
    costs = None
    if method.strip().lower() == "balanced":
        costs = layer_costs(specs, cost_model, batch_size=batch_size, seq_len=seq_len)
    return make_partition(
        method,
        num_stages=num_stages,
        num_layers=len(specs),
        costs=costs,
        params=parameter_costs(specs),
        kinds=[spec.kind for spec in specs],
    )
