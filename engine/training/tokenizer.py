"""Tokenizers: the byte tokenizer (no file, every string round-trips) or a Hugging Face
`tokenizer.json` (read through the `tokenizers` library, never downloaded), and byte-level BPE
trained locally the way GPT-2's was built.

A token file, a checkpoint and an exported Hugging Face folder each carry the tokenizer they
were made with, so `generate` and `transformers.AutoTokenizer` decode what the model learned.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "BYTES",
    "EOS_TOKEN",
    "TOKENIZER_CONFIG",
    "TOKENIZER_FILE",
    "ByteTokenizer",
    "HFTokenizer",
    "Tokenizer",
    "hf_tokenizer_files",
    "load_tokenizer",
    "token_dtype",
    "tokenizer_from_text",
    "train_tokenizer",
]

BYTES = "bytes"
"""The name of the byte tokenizer wherever a tokenizer is named (flags, headers)."""
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
EOS_TOKEN = "<|endoftext|>"
"""The end-of-text token `train_tokenizer` adds, GPT-2's spelling."""
_EOS_NAMES = (EOS_TOKEN, "</s>", "<|end_of_text|>", "<eos>", "<|im_end|>")
_INSTALL = "pip install tokenizers (or pip install 'meshpipe[tokenizers]')"


def token_dtype(vocab_size: int) -> str:
    """The smallest unsigned dtype that holds every id of a vocabulary."""
    return "uint8" if vocab_size <= 256 else "uint16" if vocab_size <= 1 << 16 else "uint32"


@dataclass(frozen=True)
class ByteTokenizer:
    """One token per byte of the UTF-8 text; no end-of-text token (documents are joined by a
    newline byte)."""

    name: str = BYTES
    vocab_size: int = 256
    eos_id: int | None = None
    unk_id: int | None = None
    sha256: str | None = None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        """Invalid UTF-8 (e.g. a cut-off sample) becomes U+FFFD."""
        return np.asarray(ids, dtype=np.uint8).tobytes().decode("utf-8", errors="replace")

    def files(self) -> dict[str, str]:
        """The files that carry it: none."""
        return {}


class HFTokenizer:
    """A `tokenizer.json` through the `tokenizers` library."""

    def __init__(self, text: str, name: str) -> None:
        tokenizers = _tokenizers_module(name)
        try:
            self._tok = tokenizers.Tokenizer.from_str(text)
        except Exception as error:  # the library raises its own untyped exceptions
            raise ValueError(
                f"{name} is not a tokenizer.json the `tokenizers` library reads ({error}): "
                "pass a Hugging Face tokenizer.json or the folder holding one"
            ) from None
        self.name, self.text = name, text
        self.sha256 = hashlib.sha256(text.encode()).hexdigest()
        self.vocab_size: int = self._tok.get_vocab_size(with_added_tokens=True)
        specials = {t.content: i for i, t in self._tok.get_added_tokens_decoder().items()}
        self.eos_id: int | None = next((specials[n] for n in _EOS_NAMES if n in specials), None)
        self.unk_id: int | None = _unknown_id(self._tok)

    def encode(self, text: str) -> list[int]:
        ids: list[int] = self._tok.encode(text, add_special_tokens=False).ids
        return ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        text: str = self._tok.decode(list(ids), skip_special_tokens=False)
        return text

    def files(self) -> dict[str, str]:
        """`tokenizer.json` and a `tokenizer_config.json` for `transformers`."""
        return hf_tokenizer_files(self.text, self.eos_id, self._tok.id_to_token)


Tokenizer = ByteTokenizer | HFTokenizer


def _tokenizers_module(name: str) -> Any:
    try:
        import tokenizers
    except ImportError:
        raise ValueError(
            f"reading {name} needs the Hugging Face `tokenizers` library: {_INSTALL}"
        ) from None
    return tokenizers


def _unknown_id(tok: Any) -> int | None:
    unk = getattr(tok.model, "unk_token", None)
    return None if unk is None else tok.token_to_id(unk)


def hf_tokenizer_files(text: str, eos_id: int | None, id_to_token: Any) -> dict[str, str]:
    """`tokenizer.json` and the `tokenizer_config.json` that lets
    `transformers.AutoTokenizer.from_pretrained` load it offline as a fast tokenizer."""
    eos = None if eos_id is None else id_to_token(eos_id)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": eos,
        "bos_token": eos,
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "add_prefix_space": False,
    }
    return {TOKENIZER_FILE: text, TOKENIZER_CONFIG: json.dumps(config, indent=1) + "\n"}


def tokenizer_from_text(text: str | None, name: str) -> Tokenizer:
    """The tokenizer of a stored `tokenizer.json` text; None is the byte tokenizer."""
    return ByteTokenizer() if text is None else HFTokenizer(text, name)


def load_tokenizer(spec: str | Path) -> Tokenizer:
    """`bytes`, a `tokenizer.json`, or a Hugging Face folder holding one."""
    if str(spec) == BYTES:
        return ByteTokenizer()
    path = Path(spec)
    file = path / TOKENIZER_FILE if path.is_dir() else path
    if not file.is_file():
        where = f"{path} holds no {TOKENIZER_FILE}" if path.is_dir() else f"{path} does not exist"
        raise ValueError(
            f"--tokenizer {spec}: {where}; pass `bytes`, a tokenizer.json, or a Hugging Face "
            "folder holding one (`meshpipe data train-tokenizer` makes one)"
        )
    return HFTokenizer(file.read_text(encoding="utf-8"), str(file))


def train_tokenizer(texts: Iterable[str], vocab_size: int, out: str | Path) -> HFTokenizer:
    """Byte-level BPE as GPT-2's (byte alphabet, no unknown token), with `EOS_TOKEN`; writes
    `tokenizer.json` and `tokenizer_config.json` into the folder `out`."""
    minimum = 256 + 1
    if vocab_size < minimum:
        raise ValueError(
            f"--vocab-size {vocab_size} is too small: byte-level BPE needs the 256 bytes and the "
            f"end-of-text token; give at least {minimum}"
        )
    t = _tokenizers_module("train-tokenizer")
    tok = t.Tokenizer(t.models.BPE())
    tok.pre_tokenizer = t.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = t.decoders.ByteLevel()
    trainer = t.trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=t.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    trained = HFTokenizer(tok.to_str(), TOKENIZER_FILE)
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in trained.files().items():
        (folder / name).write_text(text, encoding="utf-8")
    return trained
