"""The link between ranks on this host, measured: what `meshpipe plan --profile` prices its
collectives and transfers with, as it times the layers here.

A few processes join a gloo group and all-reduce a small and a large tensor, each after a
burst of compute, as training issues them (gloo's threads then sleep and wake between
collectives, and the peers arrive apart); the latency and bandwidth of the ring all-reduce the
cost model uses (`all_reduce_time`) are fitted to the two.

The price of a size is the **mean** of its samples, not the median: a step pays every
collective it runs, so its time is their sum. On this development VM a 64 KiB all-reduce after
compute ranges from 0.4 ms (the tenth percentile) to 5-8 ms (the ninetieth) within one run;
the median landed anywhere from 0.2 to 2 ms from run to run (a tensor-parallel plan then
predicted 34 % under its measured step in one run and 23 % over in the next), the mean at
2.4-2.9 ms, what a tensor-parallel step's forward pays per all-reduce inside a run (about 2 ms).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.multiprocessing.spawn import spawn

from engine.config import require

__all__ = ["LINK_SIZES", "fitted_link", "measured_link"]

LINK_SIZES = (64 * 1024, 8 * 1024 * 1024)
"""Bytes of the two all-reduces the link is fitted from: a tensor-parallel activation's order
and a data-parallel gradient bucket's."""

_BURST = (256, 256, 1024)
"""(rows, inner, columns) of the GEMM each rank runs twice before each timed all-reduce, about
3 ms on a CPU core: a layer's worth of work, as training runs between two collectives."""

_WARMUP = 5
"""Samples of each size left out: the group's first collectives set up its connections."""


def fitted_link(small: float, large: float, ranks: int) -> tuple[float, float]:
    """(latency, bandwidth) of the ring all-reduce `2(r - 1)(n / (r · bandwidth) + latency)`
    that takes `small` and `large` seconds at `LINK_SIZES` over `ranks` ranks."""
    require(ranks >= 2, f"ranks={ranks}: a link needs at least 2")
    require(
        large > small > 0,
        f"the link's all-reduces took {small * 1e3:.3f} ms at {LINK_SIZES[0]} B and "
        f"{large * 1e3:.3f} ms at {LINK_SIZES[1]} B: the larger must take longer; measure "
        "again on a quieter machine, or give --link-bandwidth and --latency",
    )
    steps = 2 * (ranks - 1)
    slope = (large - small) / (LINK_SIZES[1] - LINK_SIZES[0])
    latency = max(small - slope * LINK_SIZES[0], 0.0) / steps
    return latency, steps / (ranks * slope)


def measured_link(
    ranks: int = 2, samples: int = 60, timeout_s: float = 60.0
) -> tuple[float, float]:
    """(latency, bandwidth) of gloo between `ranks` processes of this host (`fitted_link` to
    the mean all-reduce time at each of `LINK_SIZES`, each after a burst of compute). A peer
    that does not arrive within `timeout_s` raises instead of hanging."""
    require(ranks >= 2 and samples >= 1, f"ranks={ranks}, samples={samples}: give >= 2 and >= 1")
    with tempfile.TemporaryDirectory() as folder:
        out = f"{folder}/seconds"
        spawn(
            _all_reduce_seconds,
            args=(ranks, f"{folder}/store", out, samples, timeout_s),
            nprocs=ranks,
        )
        small, large = map(float, Path(out).read_text().split())
    return fitted_link(small, large, ranks)


def _all_reduce_seconds(
    rank: int, ranks: int, store: str, out: str, samples: int, timeout_s: float
) -> None:
    """One rank's mean seconds of an all-reduce at each of `LINK_SIZES` (rank 0 writes)."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=ranks,
        timeout=timedelta(seconds=timeout_s),
    )
    rows, inner, columns = _BURST
    a, b = torch.randn(rows, inner), torch.randn(inner, columns)
    seconds = []
    for size in LINK_SIZES:
        tensor = torch.ones(size // 4)
        taken = []
        for _ in range(_WARMUP + samples):
            for _ in range(2):
                torch.mm(a, b)
            start = time.perf_counter()
            dist.all_reduce(tensor)
            taken.append(time.perf_counter() - start)
        seconds.append(statistics.mean(taken[_WARMUP:]))
    if rank == 0:
        Path(out).write_text(" ".join(map(str, seconds)))
    dist.destroy_process_group()
