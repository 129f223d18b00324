"""Partitioners: per-layer costs in, stage boundaries out.

The methods are pure Python; only `partitioners.costs` uses torch, to measure layers.
"""

from partitioners.costs import COST_MODELS, layer_costs, partition_model
from partitioners.fitting import StageFits, fastest_fitting, min_bottleneck
from partitioners.methods import (
    PARTITION_METHODS,
    balanced,
    by_parameters,
    by_type,
    explicit,
    make_partition,
    uniform,
)
from partitioners.partition import Partition

__all__ = [
    "COST_MODELS",
    "PARTITION_METHODS",
    "Partition",
    "StageFits",
    "balanced",
    "by_parameters",
    "by_type",
    "explicit",
    "fastest_fitting",
    "layer_costs",
    "make_partition",
    "min_bottleneck",
    "partition_model",
    "uniform",
]
