"""Optimizers: plain, or with masters and state sharded over the data-parallel replicas
(ZeRO-1/2, `engine.parallel`).

Weight decay applies to matrices only (not to norms, biases or other 1-D parameters), as in
GPT-2 and Llama training recipes. Every implementation updates each tensor on its own, so a
stage's optimizer and a single-process one produce the same bits.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from engine.config import OptimizerSpec
from engine.parallel import ShardedOptimizer

__all__ = ["build_from_spec", "build_optimizer", "build_sharded"]


def _param_groups(
    named: Iterable[tuple[str, nn.Parameter]], weight_decay: float
) -> list[dict[str, object]]:
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for _, param in named:
        if param.requires_grad:
            (decay if param.dim() >= 2 else no_decay).append(param)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def _optimizer_class(
    name: str, impl: str, betas: tuple[float, float], momentum: float, eps: float = 1e-8
) -> tuple[Any, dict[str, Any]]:
    """The class and keyword arguments of an optimizer implementation.

    Every implementation updates each tensor on its own, so a stage's optimizer and a
    single-process one produce the same bits for the same implementation.
    """
    OptimizerSpec(name=name, impl=impl)  # the one check of both names
    split = {"fused": {"fused": True}, "per_tensor": {"foreach": False}}
    if name == "sgd":
        return torch.optim.SGD, {"momentum": momentum, **split[impl]}
    if impl == "deepspeed_cpu":
        try:
            from deepspeed.ops.adam import DeepSpeedCPUAdam
        except ImportError as error:
            raise ValueError(
                "deepspeed_cpu needs deepspeed: pip install 'meshpipe[deepspeed]'"
            ) from error
        return DeepSpeedCPUAdam, {"betas": betas, "eps": eps, "adamw_mode": True}
    return torch.optim.AdamW, {"betas": betas, "eps": eps, **split[impl]}


def build_optimizer(
    module: nn.Module,
    *,
    name: str = "adamw",
    lr: float,
    weight_decay: float = 0.0,
    betas: tuple[float, float] = (0.9, 0.95),
    momentum: float = 0.0,
    impl: str = "fused",
    eps: float = 1e-8,
) -> torch.optim.Optimizer:
    """An optimizer over `module`'s parameters, with decay on matrices only."""
    cls, kwargs = _optimizer_class(name, impl, betas, momentum, eps)
    return cls(_param_groups(module.named_parameters(), weight_decay), lr=lr, **kwargs)


def build_from_spec(spec: OptimizerSpec, module: nn.Module) -> torch.optim.Optimizer:
    """The optimizer `spec` describes, over `module`'s parameters."""
    return build_optimizer(
        module,
        name=spec.name,
        lr=spec.lr,
        weight_decay=spec.weight_decay,
        betas=spec.betas,
        momentum=spec.momentum,
        impl=spec.impl,
        eps=spec.eps,
    )


def build_sharded(
    spec: OptimizerSpec,
    module: nn.Module,
    *,
    level: int,
    dtype: torch.dtype,
    group: dist.ProcessGroup | None,
    dp: int,
    dp_rank: int,
    tp_group: dist.ProcessGroup | None = None,
) -> ShardedOptimizer:
    """ZeRO-`level` (1 or 2) over `group`: the same optimizer class and groups as
    `build_from_spec`, stepping this rank's flat master shards (of its tp shards, with
    `tp_group`)."""
    cls, kwargs = _optimizer_class(spec.name, spec.impl, spec.betas, spec.momentum, spec.eps)
    groups = _param_groups(module.named_parameters(), spec.weight_decay)
    return ShardedOptimizer(
        module,
        groups,
        lambda inner: cls(inner, lr=spec.lr, **kwargs),  # type: ignore[no-any-return]
        level=level,
        dtype=dtype,
        group=group,
        dp=dp,
        dp_rank=dp_rank,
        tp_group=tp_group,
    )
