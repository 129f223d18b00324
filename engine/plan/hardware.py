"""The machine a plan is made for: how fast a device computes and how fast its links move bytes.

Collective times follow the ring algorithm's volumes (an all-reduce moves `2(n-1)/n` of the
message per rank, a gather or scatter `(n-1)/n`), at the bandwidth of the slowest link the
group spans: within a node (`link_bandwidth`) or across nodes (`inter_node_bandwidth`).
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.config import require

__all__ = [
    "ADAMW_BYTES_PER_PARAMETER",
    "Hardware",
    "all_gather_time",
    "all_reduce_time",
    "reduce_scatter_time",
]

ADAMW_BYTES_PER_PARAMETER = 28
"""Bytes AdamW's update moves per fp32 parameter: it reads the weight, its gradient and both
moments and writes the weight and both moments back (7 × 4 B), one pass over memory."""


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
    """Bytes/s of one device's memory: the optimizer's update, after a rank's last backward,
    streams its parameters and states once (`update_time`)."""

    def __post_init__(self) -> None:
        rates = ("device_flops", "link_bandwidth", "inter_node_bandwidth", "memory_bandwidth")
        for name in (*rates, "latency"):
            value = getattr(self, name)
            flag = "--" + name.replace("_", "-")
            require(value >= 0 if name == "latency" else value > 0, f"{flag} {value}: give > 0")
        require(
            0 < self.compute_efficiency <= 1,
            f"--compute-efficiency {self.compute_efficiency}: give a fraction in (0, 1]",
        )
        require(self.gpus_per_node >= 1, f"--gpus-per-node {self.gpus_per_node}: give >= 1")

    def update_time(self, parameters: float) -> float:
        """Seconds of AdamW's update of `parameters` fp32 parameters on one device."""
        return ADAMW_BYTES_PER_PARAMETER * parameters / self.memory_bandwidth

    @property
    def achieved_flops(self) -> float:
        return self.device_flops * self.compute_efficiency

    def bandwidth(self, width: int) -> float:
        """Bandwidth of a group spanning `width` consecutive global ranks (a node holds
        `gpus_per_node` of them; the bound assumes a group that fits may still straddle two
        nodes only when it is wider than one)."""
        return self.link_bandwidth if width <= self.gpus_per_node else self.inter_node_bandwidth


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
