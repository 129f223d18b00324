"""A run's data: its token files, checked against the model, and the loaders of its training
and validation batches."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

from engine.training.batches import BatchLoader
from engine.training.config import TrainConfig
from engine.training.data import TokenDataset, default_corpus
from engine.training.documents import documents_of, split_validation
from engine.training.run_data import open_training_data

__all__ = ["RunData", "open_data", "open_dataset"]


def _opened(path: str, config: TrainConfig, *, raw: bool) -> TokenDataset:
    """A token file of the run, checked against the model's vocabulary; `raw`: the training
    data, which --vocab-size and --tokenizer describe when it has no header."""
    data = config.data
    dataset, _ = open_training_data(
        path,
        vocab_size=data.vocab_size if raw else None,
        tokenizer=data.tokenizer if raw else None,
        model_vocab=config.model.config().vocab_size,
        model=config.model.name,
    )
    return dataset


def open_dataset(config: TrainConfig) -> TokenDataset:
    """The run's token data, checked against the model's vocabulary."""
    return _opened(config.data.data or str(default_corpus().bin_path), config, raw=True)


@dataclass(frozen=True)
class RunData:
    """The loaders of a run on one dp rank."""

    train: BatchLoader
    val: BatchLoader | None
    """Validation batches (epoch 0 of the held-out data, in the order of seed 0), or None."""


def open_data(config: TrainConfig, *, dp_rank: int = 0) -> RunData:
    """The training loader and, with --val-data or --val-fraction, the validation one.

    Validation batches use the training batch's shape and the layout's dp sharding, so they
    run through the same pipeline schedule.
    """
    data = config.data
    dataset = open_dataset(config)
    documents, held_out = documents_of(dataset), None
    if data.val_fraction > 0:
        documents, held_out = split_validation(documents, data.val_fraction)
    loader = partial(
        BatchLoader,
        seq_len=config.batch.seq_len,
        global_batch=config.batch.global_batch,
        dp_rank=dp_rank,
        dp_size=config.parallel.dp,
        pack_documents=data.pack_documents,
    )
    train = loader(dataset, seed=config.run.seed, order=data.data_order, documents=documents)
    if data.val_data is not None:
        return RunData(train, loader(_opened(data.val_data, config, raw=False), seed=0))
    if held_out is None:
        return RunData(train, None)
    return RunData(train, loader(dataset, seed=0, documents=held_out))
