"""meshpipe's engine: schedules, the pipeline runtime on a mesh, data, training and the CLI."""

from engine.actions import Action, ActionKind
from engine.config import TrainConfig
from engine.data import BatchLoader, TokenDataset, default_corpus, load_tokens, prepare
from engine.engine import PipelineEngine, StepStats
from engine.mesh import Mesh, init_mesh
from engine.optim import build_optimizer, lr_factor
from engine.passes import add_communication
from engine.reference import accumulate_gradients, reference_step, split_micro_batches
from engine.schedules import Schedule, gpipe, inference, make_schedule, one_f_one_b
from engine.train import TrainResult, train
from engine.validate import ActionCosts, simulate, validate

__all__ = [
    "Action",
    "ActionCosts",
    "ActionKind",
    "BatchLoader",
    "Mesh",
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
    "gpipe",
    "inference",
    "init_mesh",
    "load_tokens",
    "lr_factor",
    "make_schedule",
    "one_f_one_b",
    "prepare",
    "reference_step",
    "simulate",
    "split_micro_batches",
    "train",
    "validate",
]
