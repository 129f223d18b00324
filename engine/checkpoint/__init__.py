"""Checkpoints: collective save and load, on-disk files and indexes, the metadata manifest, the
folder's owner lock, atomic writes, RNG states, and Hugging Face names and folders.
"""

from engine.checkpoint.files import (
    CheckpointError,
    TrainerState,
    checkpoint_candidates,
    has_checkpoint,
    read_trainer,
    step_dirs,
)
from engine.checkpoint.load import load_checkpoint, load_model_weights
from engine.checkpoint.manifest import verify_manifest
from engine.checkpoint.owner import FolderLock
from engine.checkpoint.save import save_checkpoint

__all__ = [
    "CheckpointError",
    "FolderLock",
    "TrainerState",
    "checkpoint_candidates",
    "has_checkpoint",
    "load_checkpoint",
    "load_model_weights",
    "read_trainer",
    "save_checkpoint",
    "step_dirs",
    "verify_manifest",
]
