"""Freed host memory kept for reuse on the CPU, as CUDA's caching allocator keeps device memory.

glibc hands freed memory back to the kernel (a block above its mmap threshold at once, the
heap's top once more than its trim threshold is free there), and the next allocation of that
memory faults every page in again. A split backward frees each micro-batch's recorded Linear
inputs and output gradients together at its W: on the CPU, glibc's defaults cost meshpipe's
ZB-V 41 k page faults a step and about 2 % of its step time against torch's ZB-V, level once
the memory is kept (docs/BENCHMARKS.md, "The allocator, not the schedule"). The engine raises
both thresholds once per process where it computes on the CPU; a process that set either
through glibc's environment (`MALLOC_MMAP_THRESHOLD_`, `MALLOC_TRIM_THRESHOLD_`) keeps its own.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys

__all__ = ["KEPT_MMAP_THRESHOLD", "KEPT_TRIM_THRESHOLD", "keep_freed_host_memory"]

KEPT_MMAP_THRESHOLD = 32 * 2**20
"""Blocks up to this size come from the heap, not a fresh mmap (glibc's largest on 64-bit)."""
KEPT_TRIM_THRESHOLD = 2**30
"""Free memory at the heap's top kept up to this much before any goes back to the kernel."""

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
_USERS_OWN = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")


@functools.cache
def keep_freed_host_memory() -> bool:
    """Raise glibc's mmap and trim thresholds for this process; whether it did (not off
    Linux, not under another C library, not where the environment set either)."""
    if sys.platform != "linux" or any(name in os.environ for name in _USERS_OWN):
        return False
    libc = ctypes.CDLL(None)
    if not hasattr(libc, "gnu_get_libc_version") or not hasattr(libc, "mallopt"):
        return False  # musl and others: their own allocator, other parameters
    mallopt = libc.mallopt
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    mmap = mallopt(_M_MMAP_THRESHOLD, KEPT_MMAP_THRESHOLD)
    return bool(mmap) and bool(mallopt(_M_TRIM_THRESHOLD, KEPT_TRIM_THRESHOLD))
