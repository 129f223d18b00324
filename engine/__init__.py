"""meshpipe's engine: schedules, the pipeline runtime on a mesh, data, training and the CLI."""

from engine.checkpoint import load_checkpoint, save_checkpoint
from engine.checkpoint.files import CheckpointError
from engine.comm.mesh import Mesh, init_mesh
from engine.memory.estimate import MemoryConfig, estimate_memory
from engine.runtime.engine import PipelineEngine
from engine.runtime.micro_batches import split_micro_batches
from engine.runtime.optim import OptimizerSpec, build_optimizer, lr_factor
from engine.runtime.options import EngineOptions
from engine.runtime.reference import accumulate_gradients, reference_step
from engine.runtime.step_stats import StepStats
from engine.schedule.actions import Action, ActionKind
from engine.schedule.generators import (
    gpipe,
    inference,
    interleaved_1f1b,
    looped_bfs,
    make_schedule,
    one_f_one_b,
    zb_drain,
    zb_h1,
    zb_h2,
)
from engine.schedule.passes import add_communication
from engine.schedule.schedule import Schedule
from engine.schedule.simulate import ActionCosts, simulate, steady_state_bubble
from engine.schedule.text import load_schedule, save_schedule
from engine.schedule.validate import validate
from engine.training.batches import BatchLoader
from engine.training.config import TrainConfig
from engine.training.data import TokenDataset, default_corpus, load_tokens, prepare
from engine.training.loop import TrainResult, train

__all__ = [
    "Action",
    "ActionCosts",
    "ActionKind",
    "BatchLoader",
    "CheckpointError",
    "EngineOptions",
    "MemoryConfig",
    "Mesh",
    "OptimizerSpec",
    "PipelineEngine",
    "Schedule",
    "StepStats",
    "TokenDataset",
    "TrainConfig",
    "TrainResult",
    "accumulate_gradients",
    "add_communication",
    "build_optimizer",
    "default_corpus",
    "estimate_memory",
    "gpipe",
    "inference",
    "init_mesh",
    "interleaved_1f1b",
    "load_checkpoint",
    "load_schedule",
    "load_tokens",
    "looped_bfs",
    "lr_factor",
    "make_schedule",
    "one_f_one_b",
    "prepare",
    "reference_step",
    "save_checkpoint",
    "save_schedule",
    "simulate",
    "split_micro_batches",
    "steady_state_bubble",
    "train",
    "validate",
    "zb_drain",
    "zb_h1",
    "zb_h2",
]
