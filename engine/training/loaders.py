"""A run's data: its token files, checked against the model, and the loaders of its training
and validation batches."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

from engine.training.batches import BatchLoader
from engine.training.config import TrainConfig
from engine.training.data import TokenDataset, default_corpus, load_tokens
from engine.training.documents import documents_of, split_validation

__all__ = ["RunData", "open_data", "open_dataset"]


def _checked(dataset: TokenDataset, config: TrainConfig) -> TokenDataset:
    vocab = config.model.config().vocab_size
    if dataset.info.vocab_size > vocab:
        raise ValueError(
            f"data {dataset.info.bin_path} has vocabulary {dataset.info.vocab_size} but "
            f"{config.model.model} embeds only {vocab} tokens: use a model with a larger vocabulary"
        )
    return dataset


def open_dataset(config: TrainConfig) -> TokenDataset:
    """The run's token data, checked against the model's vocabulary."""
    path = config.data.data or default_corpus().bin_path
    return _checked(load_tokens(path), config)


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
        return RunData(train, loader(_checked(load_tokens(data.val_data), config), seed=0))
    if held_out is None:
        return RunData(train, None)
    return RunData(train, loader(dataset, seed=0, documents=held_out))
