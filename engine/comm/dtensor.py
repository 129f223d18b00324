"""DTensors told apart without importing them.

`torch.distributed.tensor` (and sympy with it) costs one to two seconds of every process's
start on a small CPU, and only tensor parallelism and ZeRO-3 make DTensors. No DTensor can
exist before that module is imported, so its absence from `sys.modules` answers `is_dtensor`
without importing it; code that builds DTensors imports torch's modules where it runs.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, TypeGuard

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

__all__ = ["is_dtensor"]


def is_dtensor(value: object) -> TypeGuard[DTensor]:
    """Whether `value` is a DTensor (a tensor-parallel or ZeRO-3 shard, or a replicated one)."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(value, module.DTensor)
