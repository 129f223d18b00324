"""The training loop and what surrounds it: configuration, data and batches, metrics, traces,
preflight and resume checks, DeepSpeed configs, text generation.
"""

from engine.training.batches import BatchLoader
from engine.training.config import TrainConfig
from engine.training.data import TokenDataset, default_corpus, load_tokens, prepare
from engine.training.loop import TrainResult, train
from engine.training.tokenizer import load_tokenizer, train_tokenizer

__all__ = [
    "BatchLoader",
    "TokenDataset",
    "TrainConfig",
    "TrainResult",
    "default_corpus",
    "load_tokenizer",
    "load_tokens",
    "prepare",
    "train",
    "train_tokenizer",
]
