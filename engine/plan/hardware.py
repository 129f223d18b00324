"""The machine a plan is made for: how fast a device computes and how fast its links move bytes.

Collective times follow the ring algorithm's volumes (an all-reduce moves `2(n-1)/n` of the
message per rank, a gather or scatter `(n-1)/n`), at the bandwidth of the slowest link the
group spans: within a node (`link_bandwidth`) or across nodes (`inter_node_bandwidth`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from engine.config import require

__all__ = [
    "ACCELERATORS",
    "STEP_BYTES_PER_PARAMETER",
    "Accelerator",
    "Hardware",
    "accelerator",
    "all_gather_time",
    "all_reduce_time",
    "reduce_scatter_time",
]

STEP_BYTES_PER_PARAMETER = 40
"""Bytes a rank's optimizer phase moves per fp32 parameter, one pass each: the gradients'
global norm reads the gradient (4 B), clipping (`meshpipe train`'s default, at 1.0) reads and
writes it (8 B), and AdamW reads the weight, its gradient and both moments and writes the
weight and both moments back (28 B)."""


@dataclass(frozen=True, kw_only=True)
class Hardware:
    """Rates of one device and its links (defaults: an H100 SXM node, bf16 dense)."""

    device_flops: float = 989e12
    """Peak FLOP/s of one device (MFU is reported against it)."""
    compute_efficiency: float = 0.5
    """Fraction of the peak a layer's kernels reach (GEMMs at realistic sizes: 0.4-0.6)."""
    link_bandwidth: float = 50e9
    """Bytes/s per device to a device of the same node (NVLink-class)."""
    inter_node_bandwidth: float = 25e9
    """Bytes/s per device to a device of another node (the NIC)."""
    gpus_per_node: int = 8
    """Devices per node: tensor parallelism stays within one."""
    latency: float = 10e-6
    """Seconds each message or collective step costs on top of its bytes."""
    memory_bandwidth: float = 3.35e12
    """Bytes/s of one device's memory: the optimizer phase, after a rank's last backward,
    streams its gradients, parameters and states (`update_time`)."""
    reduce_scatter_factor: float = 1.0
    """The backend's reduce-scatter time over a ring's at the link's bandwidth and latency
    (ZeRO-2/3's gradients): 1 for NCCL's ring; gloo between a CPU host's processes takes 2-3×
    (--profile measures it)."""
    all_gather_factor: float = 1.0
    """The same for an all-gather (ZeRO-1/2/3's weights): gloo on a CPU host about 1.2-1.5×."""
    host_cores: int = 0
    """CPU cores the plan's ranks share on one host (a CPU run of this host's processes, as
    --profile plans), shared fairly among the ranks computing at each moment; 0: each rank
    computes on a device of its own."""

    def __post_init__(self) -> None:
        rates = ("device_flops", "link_bandwidth", "inter_node_bandwidth", "memory_bandwidth")
        factors = ("reduce_scatter_factor", "all_gather_factor")
        for name in (*rates, *factors, "latency"):
            value = getattr(self, name)
            flag = "--" + name.replace("_", "-")
            require(value >= 0 if name == "latency" else value > 0, f"{flag} {value}: give > 0")
        require(
            0 < self.compute_efficiency <= 1,
            f"--compute-efficiency {self.compute_efficiency}: give a fraction in (0, 1]",
        )
        require(self.gpus_per_node >= 1, f"--gpus-per-node {self.gpus_per_node}: give >= 1")
        require(
            self.host_cores >= 0,
            f"--host-cores {self.host_cores}: give the cores this host's ranks share, or 0",
        )

    def slots(self, group: int) -> float:
        """Cores a pipeline rank's `group` of processes (its dp × tp ranks, computing alike)
        comes to on the host; unbounded where each rank has a device of its own."""
        return self.host_cores / group if self.host_cores else math.inf

    def update_time(self, parameters: float) -> float:
        """Seconds of one device's optimizer phase over `parameters` fp32 parameters: the
        gradients' norm, their clipping and AdamW's update."""
        return STEP_BYTES_PER_PARAMETER * parameters / self.memory_bandwidth

    @property
    def achieved_flops(self) -> float:
        return self.device_flops * self.compute_efficiency

    def bandwidth(self, width: int) -> float:
        """Bandwidth of a group spanning `width` consecutive global ranks (a node holds
        `gpus_per_node` of them; the bound assumes a group that fits may still straddle two
        nodes only when it is wider than one)."""
        return self.link_bandwidth if width <= self.gpus_per_node else self.inter_node_bandwidth

    def all_gather(self, nbytes: float, ranks: int, width: int) -> float:
        """Seconds of this backend's all-gather of `nbytes` in total over `ranks` ranks, a
        group spanning `width` global ranks: a ring's, times `all_gather_factor`."""
        ring = all_gather_time(nbytes, ranks, self.bandwidth(width), self.latency)
        return self.all_gather_factor * ring

    def reduce_scatter(self, nbytes: float, ranks: int, width: int) -> float:
        """Seconds of this backend's reduce-scatter of `nbytes` (as `all_gather`), times
        `reduce_scatter_factor`."""
        ring = reduce_scatter_time(nbytes, ranks, self.bandwidth(width), self.latency)
        return self.reduce_scatter_factor * ring


@dataclass(frozen=True, kw_only=True)
class Accelerator:
    """One accelerator's datasheet rates, what `meshpipe plan --accelerator NAME` sets: its
    dense bf16 peak and its memory's bandwidth. Its links depend on the system it is in, and
    how much of its memory a rank may use on the run, so those stay flags."""

    device_flops: float
    memory_bandwidth: float
    memory_gb: int
    """What it holds by its datasheet, in the datasheet's GB (the budget a rank may use is
    still --device-memory)."""


ACCELERATORS: dict[str, Accelerator] = {
    "a100-40gb": Accelerator(device_flops=312e12, memory_bandwidth=1.555e12, memory_gb=40),
    "a100-80gb": Accelerator(device_flops=312e12, memory_bandwidth=2.039e12, memory_gb=80),
    "h100-pcie": Accelerator(device_flops=756e12, memory_bandwidth=2.0e12, memory_gb=80),
    "h100-sxm": Accelerator(device_flops=989e12, memory_bandwidth=3.35e12, memory_gb=80),
    "h200-sxm": Accelerator(device_flops=989e12, memory_bandwidth=4.8e12, memory_gb=141),
    "mi300x": Accelerator(device_flops=1307e12, memory_bandwidth=5.3e12, memory_gb=192),
}
"""NVIDIA's A100 (SXM), H100 and H200 and AMD's MI300X datasheets: dense bf16 FLOP/s (no
sparsity), HBM bandwidth."""


def accelerator(name: str) -> Accelerator:
    """The named accelerator's rates; an unknown name is refused with the known ones."""
    key = name.strip().lower()
    require(
        key in ACCELERATORS,
        f"--accelerator {name!r}: not an accelerator meshpipe knows; choose one of "
        f"{', '.join(ACCELERATORS)}, or give its rates with --device-flops and "
        "--memory-bandwidth",
    )
    return ACCELERATORS[key]


def all_reduce_time(nbytes: float, ranks: int, bandwidth: float, latency: float) -> float:
    """Ring all-reduce of `nbytes` over `ranks` ranks."""
    if ranks <= 1:
        return 0.0
    return 2 * (ranks - 1) * (nbytes / ranks / bandwidth + latency)


def all_gather_time(nbytes: float, ranks: int, bandwidth: float, latency: float) -> float:
    """Ring all-gather of a tensor of `nbytes` in total (each rank holds 1/ranks of it)."""
    if ranks <= 1:
        return 0.0
    return (ranks - 1) * (nbytes / ranks / bandwidth + latency)


reduce_scatter_time = all_gather_time
"""A ring reduce-scatter moves what an all-gather of the same tensor moves."""
