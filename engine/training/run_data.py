"""A run's data: its token file and the tokenizer that made it, checked against the model
before any rank starts (`preflight`) and on every rank (`loop`); the tokenizer's files go into
each checkpoint."""

from __future__ import annotations

from pathlib import Path

from engine.checkpoint.files import CheckpointError
from engine.checkpoint.hf_interop import model_folder
from engine.checkpoint.hf_interop import tokenizer_files as carried_files
from engine.training.data import TokenDataset, TokenFileInfo, load_tokens
from engine.training.tokenizer import (
    TOKENIZER_FILE,
    ByteTokenizer,
    HFTokenizer,
    Tokenizer,
    load_tokenizer,
)

__all__ = ["check_model_tokenizer", "open_training_data", "tokenizer_files"]


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
    path: str | Path,
    *,
    vocab_size: int | None,
    tokenizer: str | None,
    model_vocab: int,
    model: str = "the model",
) -> tuple[TokenDataset, Tokenizer | None]:
    """A run's token data and its tokenizer (None: a raw file with no --tokenizer), refused
    when `model` cannot embed its ids."""
    dataset = load_tokens(path, vocab_size=vocab_size)
    chosen = _data_tokenizer(dataset.info, tokenizer)
    if dataset.info.vocab_size > model_vocab:
        raise ValueError(
            f"data {dataset.info.bin_path} has vocabulary {dataset.info.vocab_size} but "
            f"{model} embeds only {model_vocab} tokens: use a model with a larger vocabulary "
            "(--model-config with a larger vocab_size)"
        )
    return dataset, chosen


def tokenizer_files(info: TokenFileInfo, given: str | None) -> dict[str, str]:
    """The tokenizer files a checkpoint of a run on these tokens carries (none: bytes, or a
    raw file without --tokenizer)."""
    chosen = _data_tokenizer(info, given)
    return {} if chosen is None else chosen.files()


def check_model_tokenizer(flag: str, model: str, data: Tokenizer | None, where: str) -> None:
    """The model a run starts from (`--init-from`, `--resume`) carries the tokenizer of the
    data `where` (or carries none, or the data's is unknown): other ids would mean other
    words to it."""
    try:
        carried = carried_files(model).get(TOKENIZER_FILE)
        folder = model_folder(model)
    except CheckpointError:
        return  # loading it reports what is wrong
    if carried is None or data is None or data.sha256 == HFTokenizer(carried, "").sha256:
        return
    raise ValueError(
        f"{flag} {model} was trained with the tokenizer {folder / TOKENIZER_FILE}, but {where} "
        f"was made with {data.name}: prepare the data with it, `meshpipe data prepare SOURCE "
        f"--tokenizer {folder}`"
    )
