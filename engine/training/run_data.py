"""A run's data: its token file and the tokenizer that made it, checked against the model
before any rank starts (`preflight`) and on every rank (`loop`); the tokenizer's files go into
each checkpoint."""

from __future__ import annotations

from pathlib import Path

from engine.training.data import TokenDataset, TokenFileInfo, load_tokens
from engine.training.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer

__all__ = ["open_training_data", "tokenizer_files"]


def _recorded_tokenizer(info: TokenFileInfo) -> Tokenizer | None:
    """The tokenizer a token file's header names (None: a raw file, which names none)."""
    if info.json_path is None:
        return None
    if info.tokenizer is None:
        return ByteTokenizer()
    return HFTokenizer(info.tokenizer.read_text(encoding="utf-8"), str(info.tokenizer))


def _data_tokenizer(info: TokenFileInfo, given: str | None) -> Tokenizer | None:
    """The tokens' tokenizer: the header's; for a raw file the one given (--tokenizer)."""
    recorded = _recorded_tokenizer(info)
    chosen = None if given is None else load_tokenizer(given)
    if recorded is not None and chosen is not None and chosen.sha256 != recorded.sha256:
        raise ValueError(
            f"--tokenizer {given} is not the tokenizer {info.json_path} was prepared with "
            f"({recorded.name}): leave --tokenizer out (a prepared file names its own), or "
            f"prepare the data again with `meshpipe data prepare SOURCE --tokenizer {given}`"
        )
    if chosen is not None and chosen.vocab_size > info.vocab_size:
        raise ValueError(
            f"--tokenizer {given} has {chosen.vocab_size} tokens but --data {info.bin_path} "
            f"has a vocabulary of {info.vocab_size}: pass the tokenizer the file was made "
            "with, or its --vocab-size"
        )
    return recorded or chosen


def open_training_data(
    path: str | Path, *, vocab_size: int | None, tokenizer: str | None, model_vocab: int
) -> tuple[TokenDataset, Tokenizer | None]:
    """A run's token data and its tokenizer (None: a raw file with no --tokenizer), refused
    when the model cannot embed its ids."""
    dataset = load_tokens(path, vocab_size=vocab_size)
    chosen = _data_tokenizer(dataset.info, tokenizer)
    if dataset.info.vocab_size > model_vocab:
        raise ValueError(
            f"data {dataset.info.bin_path} has vocabulary {dataset.info.vocab_size} but the "
            f"model embeds only {model_vocab} tokens: use a model with a larger vocabulary "
            "(--model-config with a larger vocab_size)"
        )
    return dataset, chosen


def tokenizer_files(info: TokenFileInfo, given: str | None) -> dict[str, str]:
    """The tokenizer files a checkpoint of a run on these tokens carries (none: bytes, or a
    raw file without --tokenizer)."""
    chosen = _data_tokenizer(info, given)
    return {} if chosen is None else chosen.files()
