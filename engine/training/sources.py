"""The documents of a corpus: a text file (one document), a folder of them, JSON lines (one
document per line, its text in a field) or Parquet (one per row, through `pyarrow`); and
their tokens."""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from engine.training.tokenizer import ByteTokenizer, Tokenizer, token_dtype

__all__ = ["DEFAULT_SUFFIXES", "Counts", "Document", "collect_files", "documents", "tokenized"]

DEFAULT_SUFFIXES = (".py", ".txt", ".md", ".rst", ".jsonl", ".parquet")
"""What a folder given as the source contributes."""
_SEPARATOR = b"\n"
"""What joins documents under the byte tokenizer, which has no end-of-text token."""
_BATCH = 256
"""Documents a Hugging Face tokenizer encodes at once."""
_JSON_LINES = (".jsonl", ".ndjson")
_PARQUET = (".parquet",)


@dataclass(frozen=True)
class Document:
    """One document and where it came from (for errors)."""

    origin: str
    """The file, with the line or row of a multi-document file."""
    content: bytes | str
    """A text file's raw bytes (the byte tokenizer keeps them as they are), or a record's text."""


def collect_files(
    source: Path, suffixes: Iterable[str], excluded_dirs: frozenset[str] = frozenset()
) -> list[Path]:
    """A file, or a folder's matching files sorted by relative path parts: reproducible output."""
    if source.is_file():
        return [source]
    if not source.is_dir():
        raise ValueError(f"source {str(source)!r} does not exist; pass a text file or a folder")
    wanted = tuple(suffixes)
    found: list[Path] = []
    for root, dirs, names in os.walk(source):
        dirs[:] = [d for d in dirs if d not in excluded_dirs]
        found.extend(Path(root, n) for n in names if n.endswith(wanted))
    if not found:
        raise ValueError(
            f"no files ending in {' '.join(wanted)} under {str(source)!r}: from a folder, "
            "`meshpipe data prepare` reads only files with those suffixes. Add or rename text "
            "files there to match, or pass one file of any name as SOURCE (e.g. the folder's "
            "files joined with `cat`); from Python, prepare(..., suffixes=(...)) picks others"
        )
    return sorted(found, key=lambda p: p.relative_to(source).parts)


def _missing_field(where: str, field: str, present: Iterable[str]) -> ValueError:
    names = ", ".join(sorted(present)) or "none"
    return ValueError(
        f"{where} has no text field {field!r} (its fields: {names}): pass --text-field with "
        "the field that holds the text"
    )


def _json_lines(path: Path, field: str) -> Iterator[Document]:
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path} line {number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{where} is not JSON ({error}): fix or remove it") from None
            if not isinstance(record, dict) or field not in record:
                keys = record.keys() if isinstance(record, dict) else ()
                raise _missing_field(where, field, keys)
            text = record[field]
            if not isinstance(text, str):
                raise ValueError(
                    f"{where}: field {field!r} holds {type(text).__name__}, not text: pass "
                    "--text-field with the field that holds the text"
                )
            yield Document(where, text)


def _parquet(path: Path, field: str) -> Iterator[Document]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError(
            f"{path} is Parquet, which needs pyarrow: pip install pyarrow (or convert it to "
            "JSON lines)"
        ) from None
    table: Any = pq.ParquetFile(path)
    if field not in table.schema_arrow.names:
        raise _missing_field(str(path), field, table.schema_arrow.names)
    row = 0
    for batch in table.iter_batches(columns=[field]):
        for text in batch.column(0).to_pylist():
            row += 1
            if text is not None:
                yield Document(f"{path} row {row}", str(text))


def documents(files: Iterable[Path], text_field: str) -> Iterator[Document]:
    """Every document of `files`, in order: a JSON-lines line, a Parquet row, a whole text
    file."""
    for path in files:
        if path.name.endswith(_JSON_LINES):
            yield from _json_lines(path, text_field)
        elif path.name.endswith(_PARQUET):
            yield from _parquet(path, text_field)
        else:
            yield Document(str(path), path.read_bytes())


@dataclass
class Counts:
    """What `tokenized` consumed, for the token file's header."""

    read: int = 0
    """Bytes of source text consumed (newlines between byte-tokenized documents included)."""
    documents: int = 0
    sources: set[str] = field(default_factory=set)


def _text(doc: Document, raw: bytes, cut: bool) -> str:
    """A document's text; a cut one loses the partial character at its end."""
    try:
        return raw.decode("utf-8", errors="ignore" if cut else "strict")
    except UnicodeDecodeError as error:
        raise ValueError(
            f"{doc.origin} is not UTF-8 text ({error}): a tokenizer reads text; convert it "
            "to UTF-8 or leave it out of SOURCE"
        ) from None


def _pieces(
    docs: Iterable[Document], joined: bool, max_bytes: int | None, counts: Counts
) -> Iterator[tuple[Document, bytes, bool]]:
    """Each document's bytes (after a newline when `joined`), whether the cap cut it; stops
    once ``max_bytes`` of source text are read."""
    for doc in docs:
        raw = doc.content if isinstance(doc.content, bytes) else doc.content.encode()
        raw = (_SEPARATOR if joined and counts.documents else b"") + raw
        budget = None if max_bytes is None else max_bytes - counts.read
        cut = budget is not None and len(raw) > budget
        raw = raw[:budget]
        counts.read += len(raw)
        counts.documents += 1
        counts.sources.add(doc.origin.split(" line ")[0].split(" row ")[0])
        yield doc, raw, cut
        if max_bytes is not None and counts.read >= max_bytes:
            return


def tokenized(
    docs: Iterable[Document], tokenizer: Tokenizer, max_bytes: int | None, counts: Counts
) -> Iterator[npt.NDArray[Any]]:
    """Each document's tokens (then the end-of-text token, where the tokenizer has one), the
    byte tokenizer's joined by newlines; a Hugging Face tokenizer encodes batches of
    documents (in parallel, in its own threads)."""
    pieces = _pieces(docs, isinstance(tokenizer, ByteTokenizer), max_bytes, counts)
    if isinstance(tokenizer, ByteTokenizer):
        yield from (np.frombuffer(raw, dtype=np.uint8) for _, raw, _ in pieces)
        return
    eos = [] if tokenizer.eos_id is None else [tokenizer.eos_id]
    dtype = token_dtype(tokenizer.vocab_size)
    while batch := list(itertools.islice(pieces, _BATCH)):
        encoded = tokenizer.encode_batch([_text(*piece) for piece in batch])
        yield np.concatenate([np.asarray(ids + eos, dtype=dtype) for ids in encoded])
