"""meshpipe's engine: configuration, data, the reference trainer and the CLI."""

from engine.config import TrainConfig
from engine.data import BatchLoader, TokenDataset, default_corpus, load_tokens, prepare
from engine.optim import build_optimizer, lr_factor
from engine.reference import accumulate_gradients, reference_step, split_micro_batches
from engine.train import TrainResult, train

__all__ = [
    "BatchLoader",
    "TokenDataset",
    "TrainConfig",
    "TrainResult",
    "accumulate_gradients",
    "build_optimizer",
    "default_corpus",
    "load_tokens",
    "lr_factor",
    "prepare",
    "reference_step",
    "split_micro_batches",
    "train",
]
