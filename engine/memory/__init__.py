"""`meshpipe memory`: per-stage memory of a layout, from a replay of the real stage code on
fake tensors.
"""

from engine.config.sizes import format_size, parse_size
from engine.memory.estimate import MemoryConfig, MemoryReport, StageMemory, estimate_memory
from engine.memory.measure import measure_memory
from engine.memory.reshard import ReshardChoice, choose_reshard
from engine.memory.suggest import Suggestion, suggest

__all__ = [
    "MemoryConfig",
    "MemoryReport",
    "ReshardChoice",
    "StageMemory",
    "Suggestion",
    "choose_reshard",
    "estimate_memory",
    "format_size",
    "measure_memory",
    "parse_size",
    "suggest",
]
