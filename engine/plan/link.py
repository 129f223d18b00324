"""The link between ranks on this host, measured: what `meshpipe plan --profile` prices its
collectives and transfers with, as it times the layers here.

A few processes join a gloo group and all-reduce a small and a large tensor, each after a
burst of compute, as training issues them (gloo's threads then sleep and wake between
collectives, and the peers arrive apart); the latency and bandwidth of the ring all-reduce the
cost model uses (`all_reduce_time`) are fitted to the two.

Gloo's reduce-scatter and all-gather are not the rings the cost model assumes: between two
processes of this VM, 8 MiB reduce-scattered took 2.4× a ring's time at the all-reduce's
bandwidth (more than the all-reduce itself) and an all-gather 1.2× (session 60; ZeRO-1/2's
optimizer phase and gradient reduction took 60-75 ms a step where 21 ms was priced). So each
is timed too, at the large size, and priced as a factor over the ring (`Link`).

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
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from torch.multiprocessing.spawn import spawn

from engine.config import require
from engine.plan.hardware import reduce_scatter_time

__all__ = ["LINK_SIZES", "Link", "fitted_link", "measured_link"]

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


@dataclass(frozen=True, kw_only=True)
class Link:
    """The link between ranks of this host, as `measured_link` found it: the ring all-reduce's
    latency and bandwidth, and the backend's reduce-scatter and all-gather against a ring's
    (`Hardware.reduce_scatter_factor`, `all_gather_factor`)."""

    latency: float
    bandwidth: float
    reduce_scatter_factor: float = 1.0
    all_gather_factor: float = 1.0


def measured_link(ranks: int = 2, samples: int = 60, timeout_s: float = 60.0) -> Link:
    """Gloo between `ranks` processes of this host: the latency and bandwidth `fitted_link` to
    the mean all-reduce time at each of `LINK_SIZES`, and the mean reduce-scatter and
    all-gather of the larger over a ring's at them; each after a burst of compute. A peer
    that does not arrive within `timeout_s` raises instead of hanging."""
    require(ranks >= 2 and samples >= 1, f"ranks={ranks}, samples={samples}: give >= 2 and >= 1")
    with tempfile.TemporaryDirectory() as folder:
        out = f"{folder}/seconds"
        spawn(
            _collective_seconds,
            args=(ranks, f"{folder}/store", out, samples, timeout_s),
            nprocs=ranks,
        )
        small, large, scatter, gather = map(float, Path(out).read_text().split())
    latency, bandwidth = fitted_link(small, large, ranks)
    ring = reduce_scatter_time(LINK_SIZES[1], ranks, bandwidth, latency)  # = all_gather_time
    return Link(
        latency=latency,
        bandwidth=bandwidth,
        reduce_scatter_factor=scatter / ring,
        all_gather_factor=gather / ring,
    )


def _collective_seconds(
    rank: int, ranks: int, store: str, out: str, samples: int, timeout_s: float
) -> None:
    """One rank's mean seconds of an all-reduce at each of `LINK_SIZES`, then of a
    reduce-scatter and an all-gather of the larger (rank 0 writes)."""
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

    def mean_seconds(collective: Callable[[], object]) -> float:
        taken = []
        for _ in range(_WARMUP + samples):
            for _ in range(2):
                torch.mm(a, b)
            start = time.perf_counter()
            collective()
            taken.append(time.perf_counter() - start)
        return statistics.mean(taken[_WARMUP:])

    seconds = [mean_seconds(partial(dist.all_reduce, torch.ones(n // 4))) for n in LINK_SIZES]
    shard = torch.ones(LINK_SIZES[1] // 4 // ranks)
    whole = torch.ones(shard.numel() * ranks)
    seconds.append(mean_seconds(lambda: dist.reduce_scatter_single(shard, whole)))
    seconds.append(mean_seconds(lambda: dist.all_gather_single(whole, shard)))
    if rank == 0:
        Path(out).write_text(" ".join(map(str, seconds)))
    dist.destroy_process_group()
