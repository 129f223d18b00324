"""Token files: flat memory-mapped tokens with a JSON header (`engine.batches` draws the
training batches from them), prepared from text with a tokenizer (`tokenizer.py`), or nanoGPT's
raw `.bin` files read as they are."""

from __future__ import annotations

import codecs
import hashlib
import json
import os
import shlex
import sys
import sysconfig
from collections.abc import Iterable
from dataclasses import dataclass
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

NANOGPT = "nanogpt:"
"""`--data nanogpt:PATH`: nanoGPT's raw uint16 tokens, no header (the vocabulary from
`--vocab-size`)."""

_FORMAT = "meshpipe-tokens"
_VERSION = 2
_READS = (1, 2)
"""Header versions read: 2 added the tokenizer file, `eos_id` and `documents`."""
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


@dataclass(frozen=True, kw_only=True)
class TokenFileInfo:
    """Where a token file lives and what its header says."""

    bin_path: Path
    """The raw token file: ``num_tokens`` values of ``dtype``, nothing else."""
    json_path: Path | None
    """The header that describes ``bin_path``; written last, so its presence marks completion.
    None for a raw nanoGPT file, which has none."""
    num_tokens: int
    """Number of tokens in ``bin_path``."""
    vocab_size: int
    """Size of the tokenizer's vocabulary; every token is below it."""
    dtype: str
    """NumPy dtype name of the tokens: ``uint8`` up to 256 ids, ``uint16`` up to 65,536,
    else ``uint32`` (a raw nanoGPT file: ``uint16``)."""
    sha256: str | None = None
    """The tokens' digest, written by `prepare` (files prepared before it have none): a resumed
    run checks it is reading the data its checkpoint was trained on."""
    eos_id: int | None = None
    """The end-of-text token that ends every document; None where the file has no document
    separator (the byte tokenizer, a raw file)."""
    tokenizer: Path | None = None
    """The `tokenizer.json` the tokens were made with (a copy beside the token file); None for
    the byte tokenizer or a raw file."""


def _info(bin_path: Path, json_path: Path, header: dict[str, Any]) -> TokenFileInfo:
    keys = ("num_tokens", "vocab_size", "dtype")
    fields = {k: header[k] for k in keys}
    digest, eos, tok = header.get("sha256"), header.get("eos_id"), header.get("tokenizer")
    return TokenFileInfo(
        bin_path=bin_path,
        json_path=json_path,
        sha256=digest if isinstance(digest, str) else None,
        eos_id=eos if isinstance(eos, int) else None,
        tokenizer=json_path.parent / tok["file"] if isinstance(tok, dict) else None,
        **fields,
    )


def _quote(path: Path) -> str:
    return shlex.quote(str(path))


def _prepare_fix(prefix: Path) -> str:
    """How to (re)create the token files `prefix`.bin/.json, from the shell and from Python."""
    return (
        f"run `meshpipe data prepare SOURCE --out {_quote(prefix)}` with SOURCE your text file or "
        "folder (engine.prepare() from Python)"
    )


def token_file_pair(path: str | Path) -> tuple[Path, Path]:
    """Accept a prefix, a ``.bin`` or a ``.json`` path (or ``nanogpt:PATH``) and return the
    (bin, json) pair."""
    path = Path(str(path).removeprefix(NANOGPT))
    prefix = path.with_suffix("") if path.suffix in (".bin", ".json") else path
    return prefix.with_name(prefix.name + ".bin"), prefix.with_name(prefix.name + ".json")


def tokenizer_path(bin_path: Path) -> Path:
    """Where `prepare` copies the tokenizer: ``PREFIX.tokenizer.json`` beside the tokens."""
    return bin_path.with_name(bin_path.name.removesuffix(".bin") + ".tokenizer.json")


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
        "format": _FORMAT,
        "version": _VERSION,
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
    return _info(bin_path, json_path, header)


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
                    f"first (iconv -t UTF-8 {_quote(file)})"
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


def _raw_fix(bin_path: Path) -> str:
    return (
        f"if it is nanoGPT's raw uint16 tokens, pass --data {NANOGPT}{_quote(bin_path)} "
        "--vocab-size N (N: its tokenizer's vocabulary, 50257 for GPT-2's; "
        "load_tokens(path, vocab_size=N) from Python)"
    )


def _not_token_file(given: Path, bin_path: Path, json_path: Path) -> str | None:
    """Why `given` (as the user passed it) names no token file, or None to read its header."""
    if json_path.exists():
        return None
    if given.is_dir() or (given.is_file() and given.suffix not in (".bin", ".json")):
        what = "a folder" if given.is_dir() else "a file"
        prefix = given.with_suffix("") if given.is_file() else given
        return (
            f"{str(given)!r} is {what}, not a token file (a pair PREFIX.bin + PREFIX.json): "
            f"tokenize it with `meshpipe data prepare {_quote(given)} --out {_quote(prefix)}`, "
            f"then pass --data {_quote(prefix)} (engine.prepare() and load_tokens() from "
            "Python)"
        )
    prefix = bin_path.with_name(bin_path.name.removesuffix(".bin"))
    if not bin_path.exists():
        return f"token file {str(bin_path)!r} does not exist; to create it, {_prepare_fix(prefix)}"
    return (
        f"token header {str(json_path)!r} does not exist next to {str(bin_path)!r}, so the "
        f"tokens cannot be read; {_raw_fix(bin_path)}; else, to re-create both, "
        f"{_prepare_fix(prefix)}"
    )


def _header_problems(h: dict[str, Any]) -> list[tuple[bool, str]]:
    n, vocab, dtype = h.get("num_tokens"), h.get("vocab_size"), h.get("dtype")
    want_dtype = token_dtype(vocab) if isinstance(vocab, int) else None
    eos = h.get("eos_id")
    return [
        (h.get("format") != _FORMAT, f"is not a {_FORMAT!r} header"),
        (h.get("version") not in _READS, f"has version {h.get('version')!r}, not {_VERSION}"),
        (not (isinstance(n, int) and n > 0), f"has num_tokens={n!r}, not a positive int"),
        (not (isinstance(vocab, int) and vocab > 0), f"has vocab_size={vocab!r}, not positive"),
        (bool(_too_small(dtype, vocab)), f"has vocab_size={vocab!r}, {_too_small(dtype, vocab)}"),
        (
            dtype != want_dtype,
            f"has vocab_size={vocab!r} with dtype={dtype!r}: a vocabulary of {vocab} ids is "
            f"stored as {want_dtype!r}",
        ),
        (
            eos is not None and not (isinstance(eos, int) and 0 <= eos < (vocab or 0)),
            f"has eos_id={eos!r}, not an id of its vocabulary of {vocab}",
        ),
    ]


def _check_tokenizer_copy(json_path: Path, header: dict[str, Any], fix: str) -> None:
    """The tokenizer.json the header names is beside it, with the recorded digest."""
    record = header.get("tokenizer")
    if not isinstance(record, dict):
        return
    copy = json_path.parent / str(record.get("file"))
    if not copy.is_file():
        raise ValueError(
            f"token header {str(json_path)!r} names the tokenizer {str(copy)!r}, which is "
            f"missing; copy it back beside the tokens or, {fix}"
        )
    if hashlib.sha256(copy.read_bytes()).hexdigest() != record.get("sha256"):
        raise ValueError(
            f"tokenizer {str(copy)!r} is not the one {str(json_path)!r} was prepared with "
            f"(sha256 differs); copy the original back or, {fix}"
        )


def _too_small(dtype: object, vocab: object) -> str:
    """Why token ids of a `vocab`-word vocabulary cannot be stored as `dtype`, or ""."""
    if dtype not in ("uint8", "uint16", "uint32") or not isinstance(vocab, int):
        return ""
    ids = int(np.iinfo(str(dtype)).max) + 1
    if vocab <= ids:
        return ""
    needs = next(d for d in ("uint16", "uint32", "uint64") if np.iinfo(d).max + 1 >= vocab)
    return (
        f"more token ids than its dtype {dtype!r} holds ({ids}): the vocabulary is wrong, "
        f"or the tokens need dtype {needs!r}"
    )


def _read_header(json_path: Path) -> dict[str, Any]:
    prefix = json_path.with_name(json_path.name.removesuffix(".json"))
    where, fix = f"token header {str(json_path)!r}", f"to re-create it, {_prepare_fix(prefix)}"
    try:
        header = json.loads(json_path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{where} does not exist; {fix}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{where} is unreadable ({e}); {fix}") from None
    h = header if isinstance(header, dict) else {}
    for bad, what in _header_problems(h):
        if bad:
            raise ValueError(f"{where} {what}; {fix}")
    _check_tokenizer_copy(json_path, h, fix)
    return h


def _raw_info(bin_path: Path, vocab_size: int | None) -> TokenFileInfo:
    """nanoGPT's raw file: uint16 tokens, nothing else."""
    given = f"{NANOGPT}{bin_path}"
    if vocab_size is None or not 0 < vocab_size <= 1 << 16:
        raise ValueError(
            f"--data {given}: a raw file does not say its vocabulary; pass --vocab-size N "
            f"with N from 1 to {1 << 16} (got {vocab_size}), e.g. 50257 for GPT-2's tokenizer"
        )
    if not bin_path.is_file():
        raise ValueError(f"--data {given}: {bin_path} does not exist; give nanoGPT's train.bin")
    size = bin_path.stat().st_size
    if size < 2 or size % 2:
        raise ValueError(
            f"--data {given}: {bin_path} has {size} bytes, not a whole number of uint16 tokens; "
            "nanoGPT writes uint16: check the file, or prepare it with `meshpipe data prepare`"
        )
    return TokenFileInfo(
        bin_path=bin_path, json_path=None, num_tokens=size // 2, vocab_size=vocab_size,
        dtype="uint16",
    )  # fmt: skip


def _header_info(path: str | Path, vocab_size: int | None) -> TokenFileInfo:
    """The info of a file with a header; a header-less `.bin` with `vocab_size` is read as
    nanoGPT's raw tokens (said on stderr)."""
    bin_path, json_path = token_file_pair(path)
    if vocab_size is not None and bin_path.is_file() and not json_path.exists():
        print(f"meshpipe: {bin_path} has no header: read as nanoGPT raw uint16", file=sys.stderr)
        return _raw_info(bin_path, vocab_size)
    problem = _not_token_file(Path(path), bin_path, json_path)
    if problem is not None:
        raise ValueError(problem)
    info = _info(bin_path, json_path, _read_header(json_path))
    if vocab_size is not None and vocab_size != info.vocab_size:
        raise ValueError(
            f"--vocab-size {vocab_size} contradicts {json_path}, whose tokens have a vocabulary "
            f"of {info.vocab_size}: leave --vocab-size out (it is for raw files)"
        )
    return info


def _check_size(info: TokenFileInfo) -> None:
    prefix = info.bin_path.with_name(info.bin_path.name.removesuffix(".bin"))
    if not info.bin_path.is_file():
        raise ValueError(
            f"token file {str(info.bin_path)!r} is missing next to its header; "
            f"to re-create both, {_prepare_fix(prefix)}"
        )
    expected = info.num_tokens * np.dtype(info.dtype).itemsize
    actual = info.bin_path.stat().st_size
    if actual != expected:
        raise ValueError(
            f"token file {str(info.bin_path)!r} has {actual} bytes but its header promises "
            f"{expected} (num_tokens={info.num_tokens}); the file is truncated or "
            f"stale; to re-create it, {_prepare_fix(prefix)}"
        )


def _check_ids(tokens: npt.NDArray[Any], info: TokenFileInfo) -> None:
    """Every id is inside the vocabulary (read in chunks: a raw file has no writer's promise)."""
    step = 1 << 24
    for start in range(0, len(tokens), step):
        chunk = tokens[start : start + step]
        top = int(chunk.max())
        if top >= info.vocab_size:
            at = start + int(np.argmax(chunk >= info.vocab_size))
            raise ValueError(
                f"{info.bin_path} holds token id {top} (first out-of-range id at position {at}), "
                f"outside its vocabulary of {info.vocab_size}: pass the --vocab-size of the "
                "tokenizer that wrote it"
            )


class TokenDataset:
    """A token file, memory-mapped read-only so every rank shares the page cache."""

    def __init__(self, path: str | Path, *, vocab_size: int | None = None) -> None:
        """Open ``path`` (the ``.bin``, the ``.json`` or their prefix; ``nanogpt:PATH`` for a
        raw file of ``vocab_size`` ids) after validating it."""
        spec = str(path)
        if spec.startswith(NANOGPT):
            self.info = _raw_info(Path(spec.removeprefix(NANOGPT)), vocab_size)
        else:
            self.info = _header_info(path, vocab_size)
        _check_size(self.info)
        self.tokens: npt.NDArray[Any] = np.memmap(self.info.bin_path, self.info.dtype, mode="r")
        if self.info.json_path is None:
            _check_ids(self.tokens, self.info)

    def __len__(self) -> int:
        return self.info.num_tokens


def load_tokens(path: str | Path, *, vocab_size: int | None = None) -> TokenDataset:
    """Open a token file; ``path`` may be the ``.bin``, the ``.json`` or the prefix, or
    ``nanogpt:PATH`` (a raw uint16 file without header, whose ``vocab_size`` is given)."""
    return TokenDataset(path, vocab_size=vocab_size)
