"""The training loop and what surrounds it: configuration, data and batches, metrics, traces,
preflight and resume checks, DeepSpeed configs, text generation.
"""

from engine.training.batches import Batch, BatchLoader
from engine.training.config import TrainConfig
from engine.training.data import TokenDataset, default_corpus, load_tokens, prepare
from engine.training.documents import Documents, documents_of, split_validation
from engine.training.loop import TrainResult, train
from engine.training.tokenizer import load_tokenizer, train_tokenizer

__all__ = [
    "Batch",
    "BatchLoader",
    "Documents",
    "TokenDataset",
    "TrainConfig",
    "TrainResult",
    "default_corpus",
    "documents_of",
    "load_tokenizer",
    "load_tokens",
    "prepare",
    "split_validation",
    "train",
    "train_tokenizer",
]
