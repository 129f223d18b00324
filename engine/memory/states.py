"""Bytes that follow from parameter shapes alone, and the reference formulas we compare with.

The engine keeps fp32 weights and gradients whatever the compute precision (autocast casts inside
each op) and AdamW's two fp32 states, sharded by ZeRO-1 as torch's `ZeroRedundancyOptimizer`
assigns whole parameters. After the schedule, `BucketedAllReduce` flattens every gradient bucket
at once (dp > 1), then AdamW steps: the fused kernel in place, the per-tensor loop with two
temporaries the size of a parameter.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, replace

from torch import nn

from engine.config import ReplicaSync
from engine.memory.tp_shards import shard_for_tp
from engine.memory.tracker import round_up
from engine.parallel import castable_linear_params
from models import LayerSpec

__all__ = [
    "DP_BUCKET_BYTES",
    "OPTIMIZER_IMPLS",
    "ParamInfo",
    "StateLayout",
    "deepspeed_zero2_model_states",
    "dp_bucket_copy",
    "dp_buckets",
    "megatron_activations",
    "optimizer_bytes",
    "param_info",
    "replica_sync_bytes",
    "stage_params",
    "tail_peak",
]

DP_BUCKET_BYTES = 25 * 2**20
"""`BucketedAllReduce`'s bucket size: a bucket closes once its gradients reach 25 MiB."""


def dp_bucket_copy(gradients: int) -> int:
    """What ZeRO-0's dp all-reduce holds beside a stage's gradients at most: the one flat
    bucket it makes before that bucket's views replace them (`BucketedAllReduce.start`)."""
    return min(gradients, DP_BUCKET_BYTES)


OPTIMIZER_IMPLS = ("fused", "per_tensor")
"""AdamW implementations of `engine.optim` whose states live on the device."""


@dataclass(frozen=True, kw_only=True)
class StateLayout:
    """How a replica holds its model states on the modelled device."""

    dp: int = 1
    zero: int = 0
    zero_reshard: str = "step"
    """ZeRO-3: layers gathered for the whole step, or per micro-batch (`EngineOptions`)."""
    tp: int = 1
    """Tensor-parallel ranks: each holds its shard of every split weight."""
    block: int = 1
    """Allocation granularity (512 for CUDA)."""
    optimizer_impl: str = "fused"
    device: str = "cuda"

    @property
    def step_counters(self) -> bool:
        """AdamW's `step` scalars count: fused keeps them beside the parameters, the per-tensor
        loop on the host (which is the device when it is the CPU)."""
        return self.optimizer_impl == "fused" or self.device == "cpu"

    @property
    def temporaries(self) -> int:
        """Parameter-sized fp32 temporaries alive at once in one AdamW update: none in the fused
        kernel, two in the per-tensor loop (`exp_avg_sq.sqrt() / bias_correction`);
        `measure_memory` checks both on real tensors."""
        return 0 if self.optimizer_impl == "fused" else 2


@dataclass(frozen=True, slots=True)
class ParamInfo:
    """What the model states need to know of one parameter."""

    numel: int
    decay: bool
    """In the weight-decay group (matrices), which ZeRO-1 partitions first."""
    cast: bool = False
    """A Linear's weight that autocast casts: kept in the compute dtype under ZeRO-1/2."""
    rows: int = 0
    """Size of its first dimension (FSDP2 shards along it, padding to a multiple of dp)."""
    layer: int = 0
    """Its layer's position in the stage (ZeRO-3 gathers a layer's parameters together)."""


def param_info(module: nn.Module) -> list[ParamInfo]:
    """Parameters in `module.parameters()` order (shared ones once), as the engine sees them."""
    cast = {id(p) for p in castable_linear_params(module)}
    positions: dict[str, int] = {}
    found = []
    for name, p in module.named_parameters():
        if p.requires_grad:
            layer = positions.setdefault(_layer_key(name), len(positions))
            found.append(_info(p, id(p) in cast, layer))
    return found


def _layer_key(name: str) -> str:
    """`layers.3` of `layers.3.attn.q_proj.weight`: the layer a stack's parameter is in."""
    parts = name.split(".")
    return ".".join(parts[:2]) if parts[0] == "layers" else ""


def _info(param: nn.Parameter, cast: bool, layer: int = 0) -> ParamInfo:
    rows = param.shape[0] if param.dim() else 1
    return ParamInfo(param.numel(), param.dim() >= 2, cast, rows, layer)


def stage_params(specs: Sequence[LayerSpec], tp: int = 1) -> list[ParamInfo]:
    """`param_info(build_stage(specs))` without building the stage: each distinct layer spec
    is built on `meta` once (planning asks for the same blocks thousands of times), and a
    weight tied to an earlier layer of the stage counts once, where it first appears."""
    found: list[ParamInfo] = []
    tied: set[str] = set()
    position = 0
    for spec in specs:
        before = len(found)
        for name, info in _layer_params(spec, tp):
            if spec.tie_key is not None and name == spec.tied_param and spec.tie_key in tied:
                continue
            found.append(replace(info, layer=position))
        position += len(found) > before
        if spec.tie_key is not None:
            tied.add(spec.tie_key)
    return found


@functools.lru_cache(maxsize=256)
def _layer_params(spec: LayerSpec, tp: int = 1) -> tuple[tuple[str, ParamInfo], ...]:
    module = spec.build("meta")
    shard_for_tp([module], tp)
    cast = {id(p) for p in castable_linear_params(module)}
    return tuple(
        (name, _info(p, id(p) in cast)) for name, p in module.named_parameters() if p.requires_grad
    )


def _own(params: Sequence[ParamInfo], states: StateLayout) -> list[list[ParamInfo]]:
    """The parameters a replica steps: all of them (ZeRO's shards: `engine.memory.sharding`)."""
    return [list(params)]


def optimizer_bytes(params: Sequence[ParamInfo], states: StateLayout) -> int:
    """AdamW's exp_avg and exp_avg_sq (fp32), and its step scalars where they are on the
    device, on the replica with the largest shard."""
    step = round_up(4, states.block) if states.step_counters else 0
    return max(
        sum(2 * round_up(4 * p.numel, states.block) + step for p in shard)
        for shard in _own(params, states)
    )


def replica_sync_bytes(params: Sequence[ParamInfo], sync: ReplicaSync, block: int = 1) -> int:
    """What a `--dp-sync` keeps beside the replica's own states, per parameter of the stage:
    DiLoCo the weights of the last meeting and, with outer momentum, its buffer (fp32 each);
    the parameter server its fp32 masters on the server rank (dp rank 0), whose optimizer
    states are the `optimizer` bytes (the replicas' own optimizers never step, so hold none)."""
    copies = {
        "diloco": 1 + (sync.outer_momentum > 0),
        "parameter-server": 1,
    }.get(sync.dp_sync, 0)
    return copies * sum(round_up(4 * p.numel, block) for p in params)


def dp_buckets(params: Sequence[ParamInfo]) -> list[list[ParamInfo]]:
    """`BucketedAllReduce`'s buckets, filled in parameter order."""
    buckets: list[list[ParamInfo]] = [[]]
    size = 0
    for param in params:
        if size >= DP_BUCKET_BYTES:
            buckets.append([])
            size = 0
        buckets[-1].append(param)
        size += 4 * param.numel
    return buckets


def _fp32(params: Sequence[ParamInfo], block: int) -> int:
    return sum(round_up(4 * p.numel, block) for p in params)


def tail_peak(
    params: Sequence[ParamInfo], *, live_end: int, held: int, cached: int, states: StateLayout
) -> int:
    """Peak after the schedule, from the replay's final live bytes (gradients and the step's
    weight copies included; the copies, `cached` bytes, go when the schedule ends).

    With dp > 1 the last backward posts each bucket's flat copy while the sends are still held
    and the weight copies alive, and the bucket's gradients become views of it
    (`BucketedAllReduce.start`): a bucket is made beside its gradients, which it then
    replaces. The sends complete, the optimizer steps, its temporaries the size of the
    largest parameter the replica steps.
    """
    block = states.block
    largest = max((p.numel for shard in _own(params, states) for p in shard), default=0)
    step = states.temporaries * round_up(4 * largest, block)
    if states.dp == 1:
        return live_end - held - cached + step
    grown = posting = 0
    for bucket in dp_buckets(params):
        # each flat bucket also carries one count per gradient: which replicas held it
        flat = round_up(4 * (sum(p.numel for p in bucket) + len(bucket)), block)
        posting = max(posting, grown + flat)
        grown += flat - _fp32(bucket, block)
    return max(live_end + posting, live_end + grown - held - cached + step)


def deepspeed_zero2_model_states(params: int, num_gpus: int) -> int:
    """DeepSpeed's `estimate_zero2_model_states_mem_needs` GPU bytes without offload:
    fp16 weights and gradients (4 B) plus fp32 master, momentum, variance and gradient
    partitions (16 B / num_gpus)."""
    return 4 * params + int(16 * params / num_gpus)


def megatron_activations(
    *, seq_len: int, micro_batch_size: int, hidden: int, heads: int, layers: int, flash: bool
) -> int:
    """Korthikanti et al. 2022, eq. 1: s·b·h·(34 + 5·a·s/h) bytes per layer and micro-batch
    (16-bit, no recompute); `flash` drops the attention matrix term (5·a·s/h), as
    selective recompute or fused attention does."""
    s, b, h = seq_len, micro_batch_size, hidden
    per_layer = s * b * h * 34 + (0 if flash else 5 * heads * s * s * b)
    return layers * per_layer
