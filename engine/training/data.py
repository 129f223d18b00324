"""Token files: flat memory-mapped tokens with a JSON header (`engine.batches` draws the
training batches from them), prepared here from text with a tokenizer (`tokenizer.py`); they
are read and checked by `token_files.py`, whose names this module re-exports."""

from __future__ import annotations

import codecs
import json
import os
import sys
import sysconfig
from collections.abc import Iterable
from pathlib import Path
from typing import IO, Any

import numpy as np
import numpy.typing as npt
import torch

from engine.checkpoint.atomic import atomic_write, fsync_dir, sha256_file
from engine.training.sources import (
    DEFAULT_SUFFIXES,
    Counts,
    Document,
    collect_files,
    documents,
    tokenized,
)
from engine.training.token_files import (
    FORMAT,
    NANOGPT,
    VERSION,
    TokenDataset,
    TokenFileInfo,
    file_info,
    load_tokens,
    quote_path,
    token_file_pair,
    tokenizer_path,
)
from engine.training.tokenizer import (
    BYTES,
    ByteTokenizer,
    Tokenizer,
    load_tokenizer,
    token_dtype,
)

__all__ = [
    "NANOGPT",
    "VOCAB_SIZE",
    "TokenDataset",
    "TokenFileInfo",
    "decode",
    "default_corpus",
    "encode",
    "load_tokens",
    "prepare",
    "token_file_pair",
    "tokenizer_path",
]

VOCAB_SIZE = 256
"""Vocabulary of the byte tokenizer: one token per byte value."""

_STDLIB_EXCLUDED = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3"}
)


def encode(text: str) -> npt.NDArray[np.uint8]:
    """Encode text as its UTF-8 bytes: no vocabulary file to ship, and every string round-trips."""
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).copy()


def decode(tokens: Iterable[int] | npt.NDArray[Any] | torch.Tensor) -> str:
    """Decode byte tokens to text; invalid UTF-8 (e.g. a cut-off sample) becomes U+FFFD."""
    if isinstance(tokens, torch.Tensor):
        tokens = tokens.detach().cpu().numpy()
    return np.asarray(tokens, dtype=np.uint8).tobytes().decode("utf-8", errors="replace")


def _write_chunks(chunks: Iterable[npt.NDArray[Any]], f: IO[bytes]) -> int:
    written = 0
    for ids in chunks:
        f.write(ids.tobytes())
        written += len(ids)
    return written


def _tokenizer_header(tokenizer: Tokenizer, bin_path: Path) -> str | dict[str, str]:
    """The header's record of the tokenizer; an HF one is copied beside the tokens first."""
    if isinstance(tokenizer, ByteTokenizer):
        return BYTES
    copy = tokenizer_path(bin_path)
    atomic_write(copy, lambda f: f.write(tokenizer.text.encode()))
    return {"file": copy.name, "sha256": tokenizer.sha256}


def _write_token_file(
    docs: Iterable[Document],
    out: str | Path,
    max_bytes: int | None,
    origin: object,
    tokenizer: Tokenizer,
) -> TokenFileInfo:
    if max_bytes is not None and max_bytes < 1:
        raise ValueError(
            f"max_bytes={max_bytes} (--max-bytes) must be >= 1; leave it out (None) for no cap"
        )
    bin_path, json_path = token_file_pair(out)
    bin_path.parent.mkdir(parents=True, exist_ok=True)
    counts = Counts()
    chunks = tokenized(docs, tokenizer, max_bytes, counts)
    num_tokens = atomic_write(bin_path, lambda f: _write_chunks(chunks, f))
    if num_tokens == 0:
        bin_path.unlink()
        raise ValueError(f"source {str(origin)!r} holds no text; give it some")
    header = {
        "format": FORMAT,
        "version": VERSION,
        "dtype": token_dtype(tokenizer.vocab_size),
        "vocab_size": tokenizer.vocab_size,
        "tokenizer": _tokenizer_header(tokenizer, bin_path),
        "eos_id": tokenizer.eos_id,
        "num_tokens": num_tokens,
        "sha256": sha256_file(bin_path),
        "sources": len(counts.sources),
        "documents": counts.documents,
    }
    fsync_dir(bin_path.parent)  # the tokens are on disk before the header that vouches for them
    atomic_write(json_path, lambda f: f.write(json.dumps(header, indent=2).encode()))
    fsync_dir(json_path.parent)
    return file_info(bin_path, json_path, header)


def prepare(
    source: str | Path,
    out: str | Path,
    *,
    max_bytes: int | None = None,
    suffixes: Iterable[str] = DEFAULT_SUFFIXES,
    tokenizer: str | Path | Tokenizer = BYTES,
    text_field: str = "text",
) -> TokenFileInfo:
    """Tokenize a text file, JSON lines, Parquet, or a folder of them (recursively) into
    ``<out>.bin`` + ``<out>.json``.

    Files are read in sorted relative-path order; a text file is one document, a JSON-lines
    line or a Parquet row one (its ``text_field``). With the byte tokenizer documents are
    joined by a newline; with another, each ends with its end-of-text token. ``max_bytes``
    caps the source text read (with bytes, exactly that many tokens). ``out`` may be a prefix
    or end in ``.bin``; ``tokenizer`` is ``"bytes"``, a tokenizer.json or a folder holding one.
    """
    chosen = load_tokenizer(tokenizer) if isinstance(tokenizer, str | Path) else tokenizer
    files = collect_files(Path(source), suffixes)
    for file in files:
        if not file.name.endswith(".parquet"):
            _require_text(file)
    return _write_token_file(documents(files, text_field), out, max_bytes, source, chosen)


def _require_text(file: Path, chunk: int = 1 << 24) -> None:
    """Refuse a file that is not UTF-8 text: its bytes would train as tokens all the same,
    and an archive or a binary given by mistake would go unnoticed. Read in chunks, so a
    corpus of many GB is checked in constant memory."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0
    with file.open("rb") as f:
        while True:
            data = f.read(chunk)
            pending = len(decoder.getstate()[0])  # a character cut by the previous chunk
            try:
                decoder.decode(data, final=not data)
            except UnicodeDecodeError as error:
                at = offset - pending + error.start
                raise ValueError(
                    f"source {str(file)!r} is not UTF-8 text (byte {at} is "
                    f"{error.object[error.start]:#04x}): give text files, or convert this one "
                    f"first (iconv -t UTF-8 {quote_path(file)})"
                ) from None
            if not data:
                return
            offset += len(data)


def _cache_root(cache_dir: Path | None) -> Path:
    if cache_dir is not None:
        return Path(cache_dir)
    env = os.environ.get("MESHPIPE_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "meshpipe"


def default_corpus(cache_dir: Path | None = None, max_bytes: int = 8_000_000) -> TokenFileInfo:
    """The running interpreter's own stdlib ``.py`` sources: real text that needs no download.

    Prepared once into ``cache_dir`` (default ``$MESHPIPE_CACHE`` or ``~/.cache/meshpipe``) and
    reused while its header is valid; the name carries the Python version and ``max_bytes``.
    """
    v = sys.version_info
    name = f"stdlib-{sys.implementation.name}{v.major}.{v.minor}.{v.micro}-{max_bytes}b"
    prefix = _cache_root(cache_dir) / name
    try:
        return TokenDataset(prefix).info
    except ValueError:
        pass
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = collect_files(stdlib, (".py",), _STDLIB_EXCLUDED)
    return _write_token_file(documents(files, "text"), prefix, max_bytes, stdlib, ByteTokenizer())
