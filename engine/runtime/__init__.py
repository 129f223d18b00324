"""The pipeline runtime: the engine and its step, the one interpreter, stages, precision,
clipping, optimizers, and the single-process reference every result is compared with.
"""

from engine.config import EngineOptions, OptimizerSpec
from engine.runtime.engine import PipelineEngine
from engine.runtime.interpreter import PipelineRuntimeError
from engine.runtime.lr_schedules import lr_factor
from engine.runtime.micro_batches import LossFn, split_micro_batches
from engine.runtime.optim import build_optimizer
from engine.runtime.reference import accumulate_gradients, reference_step
from engine.runtime.stage import PipelineStage, StageError
from engine.runtime.step_stats import StepStats
from engine.runtime.weight_grads import runs_whole_backward_at_input

__all__ = [
    "EngineOptions",
    "LossFn",
    "OptimizerSpec",
    "PipelineEngine",
    "PipelineRuntimeError",
    "PipelineStage",
    "StageError",
    "StepStats",
    "accumulate_gradients",
    "build_optimizer",
    "lr_factor",
    "reference_step",
    "runs_whole_backward_at_input",
    "split_micro_batches",
]
