"""meshpipe's engine: schedules, the pipeline runtime on a mesh, data, training and the CLI."""

from engine.actions import Action, ActionKind
from engine.batches import BatchLoader
from engine.checkpoint import load_checkpoint, save_checkpoint
from engine.checkpoint_files import CheckpointError
from engine.config import TrainConfig
from engine.data import TokenDataset, default_corpus, load_tokens, prepare
from engine.engine import PipelineEngine
from engine.memory import MemoryConfig, estimate_memory
from engine.mesh import Mesh, init_mesh
from engine.optim import OptimizerSpec, build_optimizer, lr_factor
from engine.options import EngineOptions
from engine.passes import add_communication
from engine.reference import accumulate_gradients, reference_step, split_micro_batches
from engine.schedules import (
    Schedule,
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
from engine.simulate import ActionCosts, simulate, steady_state_bubble
from engine.step_stats import StepStats
from engine.timeline import load_schedule, save_schedule
from engine.train import TrainResult, train
from engine.validate import validate

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
