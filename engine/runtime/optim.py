"""Optimizers and learning-rate schedules.

Weight decay applies to matrices only (not to norms, biases or other 1-D parameters), as in
GPT-2 and Llama training recipes.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = [
    "IMPLEMENTATIONS",
    "LR_SCHEDULES",
    "OPTIMIZERS",
    "OptimizerSpec",
    "build_optimizer",
    "lr_factor",
]

OPTIMIZERS = ("adamw", "sgd")
IMPLEMENTATIONS = ("fused", "per_tensor", "deepspeed_cpu")
"""How the update runs: torch's fused CPU/CUDA kernel (default), torch's per-tensor loop, or
DeepSpeed's CPU Adam (AdamW only; fastest on CPU, see docs/BENCHMARKS.md)."""
LR_SCHEDULES = ("constant", "cosine", "linear")


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
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}: choose one of {', '.join(OPTIMIZERS)}")
    if impl not in IMPLEMENTATIONS:
        raise ValueError(
            f"unknown optimizer implementation {impl!r}: choose one of {', '.join(IMPLEMENTATIONS)}"
        )
    split = {"fused": {"fused": True}, "per_tensor": {"foreach": False}}
    if name == "sgd":
        if impl == "deepspeed_cpu":
            raise ValueError("deepspeed_cpu implements AdamW only: use fused or per_tensor")
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


@dataclass(frozen=True, kw_only=True)
class OptimizerSpec:
    """An optimizer by name and hyper-parameters, buildable plain or sharded (ZeRO-1)."""

    name: str = "adamw"
    """`adamw` or `sgd`."""
    lr: float = 1e-3
    """Learning rate."""
    weight_decay: float = 0.0
    """Decoupled weight decay on matrices."""
    betas: tuple[float, float] = (0.9, 0.95)
    """Adam's betas."""
    momentum: float = 0.0
    """SGD's momentum."""
    eps: float = 1e-8
    """Adam's epsilon, added to the root of the second moment."""
    impl: str = "fused"
    """One of `IMPLEMENTATIONS`."""

    def __post_init__(self) -> None:
        if self.name not in OPTIMIZERS:
            raise ValueError(
                f"unknown optimizer {self.name!r}: choose one of {', '.join(OPTIMIZERS)}"
            )
        if self.impl not in IMPLEMENTATIONS:
            raise ValueError(
                f"unknown optimizer implementation {self.impl!r}: choose one of "
                f"{', '.join(IMPLEMENTATIONS)}"
            )
        if not (0.0 < self.eps < math.inf):
            raise ValueError(f"eps={self.eps} must be a positive number such as 1e-8")

    def build(
        self, module: nn.Module, *, zero_group: dist.ProcessGroup | None = None
    ) -> torch.optim.Optimizer:
        """The optimizer; with `zero_group`, torch's ZeroRedundancyOptimizer sharding its
        state over that group (each replica keeps 1/dp of the moments, then broadcasts the
        parameters it updated)."""
        if zero_group is None:
            return build_optimizer(
                module,
                name=self.name,
                lr=self.lr,
                weight_decay=self.weight_decay,
                betas=self.betas,
                momentum=self.momentum,
                impl=self.impl,
                eps=self.eps,
            )
        from torch.distributed.optim import ZeroRedundancyOptimizer  # slow import: only here

        cls, kwargs = _optimizer_class(self.name, self.impl, self.betas, self.momentum, self.eps)
        groups = _param_groups(module.named_parameters(), self.weight_decay)
        return ZeroRedundancyOptimizer(
            groups, optimizer_class=cls, process_group=zero_group, lr=self.lr, **kwargs
        )


def lr_factor(
    step: int, *, schedule: str, warmup_steps: int, total_steps: int, min_ratio: float = 0.1
) -> float:
    """Multiplier of the base learning rate at `step` (0-based): linear warmup, then decay.

    `cosine` and `linear` decay from 1 to `min_ratio` between the end of warmup and
    `total_steps`; `constant` stays at 1 after warmup.
    """
    if schedule not in LR_SCHEDULES:
        raise ValueError(
            f"unknown lr schedule {schedule!r}: choose one of {', '.join(LR_SCHEDULES)}"
        )
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant" or total_steps <= warmup_steps:
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    if schedule == "linear":
        return 1.0 - (1.0 - min_ratio) * progress
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
