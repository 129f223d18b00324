"""Communication on the mesh: the pp × dp × tp process grid, local launch, pipeline channels,
p2p exchange, step reports, data-parallel gradient reduction and collectives that name their
failures.
"""

from engine.comm.collective import CollectiveError, naming_failures
from engine.comm.launch import RankFailed, is_launched, launch_local
from engine.comm.mesh import Mesh, check_device, init_mesh, launcher_world_size
from engine.comm.p2p import ExchangeError, StageExchange

__all__ = [
    "CollectiveError",
    "ExchangeError",
    "Mesh",
    "RankFailed",
    "StageExchange",
    "check_device",
    "init_mesh",
    "is_launched",
    "launch_local",
    "launcher_world_size",
    "naming_failures",
]
