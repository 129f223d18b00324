"""Token data: a byte tokenizer and flat memory-mapped token files (`engine.batches` draws the
training batches from them)."""

from __future__ import annotations

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

__all__ = [
    "VOCAB_SIZE",
    "TokenDataset",
    "TokenFileInfo",
    "decode",
    "default_corpus",
    "encode",
    "load_tokens",
    "prepare",
    "token_file_pair",
]

VOCAB_SIZE = 256
"""Vocabulary of the byte tokenizer: one token per byte value."""

_FORMAT = "meshpipe-tokens"
_VERSION = 1
_DEFAULT_SUFFIXES = (".py", ".txt", ".md", ".rst")
_STDLIB_EXCLUDED = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3"}
)
_SEPARATOR = b"\n"


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
    """Where a prepared token file lives and what its header says."""

    bin_path: Path
    """The raw token file: ``num_tokens`` values of ``dtype``, nothing else."""
    json_path: Path
    """The header that describes ``bin_path``; written last, so its presence marks completion."""
    num_tokens: int
    """Number of tokens in ``bin_path``."""
    vocab_size: int
    """Size of the tokenizer's vocabulary; every token is below it."""
    dtype: str
    """NumPy dtype name of the tokens: ``uint8`` for vocab <= 256, else ``uint16``."""
    sha256: str | None = None
    """The tokens' digest, written by `prepare` (files prepared before it have none): a resumed
    run checks it is reading the data its checkpoint was trained on."""


def _dtype_for(vocab_size: int) -> str:
    return "uint8" if vocab_size <= 256 else "uint16"


def _info(bin_path: Path, json_path: Path, header: dict[str, Any]) -> TokenFileInfo:
    keys = ("num_tokens", "vocab_size", "dtype")
    fields = {k: header[k] for k in keys}
    digest = header.get("sha256")
    return TokenFileInfo(
        bin_path=bin_path,
        json_path=json_path,
        sha256=digest if isinstance(digest, str) else None,
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
    """Accept a prefix, a ``.bin`` or a ``.json`` path and return the (bin, json) pair."""
    path = Path(path)
    prefix = path.with_suffix("") if path.suffix in (".bin", ".json") else path
    return prefix.with_name(prefix.name + ".bin"), prefix.with_name(prefix.name + ".json")


def _collect_files(
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


def _concat(files: list[Path], f: IO[bytes], max_bytes: int | None) -> tuple[int, int]:
    """Stream files into ``f`` separated by newlines; return (bytes written, files used)."""
    written = used = 0
    for i, file in enumerate(files):
        chunk = (_SEPARATOR if i else b"") + file.read_bytes()
        if max_bytes is not None:
            chunk = chunk[: max_bytes - written]
        f.write(chunk)
        written += len(chunk)
        used += 1
        if max_bytes is not None and written >= max_bytes:
            break
    return written, used


def _write_token_file(
    files: list[Path], out: str | Path, max_bytes: int | None, origin: object
) -> TokenFileInfo:
    if max_bytes is not None and max_bytes < 1:
        raise ValueError(
            f"max_bytes={max_bytes} (--max-bytes) must be >= 1; leave it out (None) for no cap"
        )
    bin_path, json_path = token_file_pair(out)
    bin_path.parent.mkdir(parents=True, exist_ok=True)
    num_tokens, used = atomic_write(bin_path, lambda f: _concat(files, f, max_bytes))
    if num_tokens == 0:
        bin_path.unlink()
        raise ValueError(f"source {str(origin)!r} holds no bytes; give it some text")
    fsync_dir(bin_path.parent)  # the tokens are on disk before the header that vouches for them
    header = {
        "format": _FORMAT,
        "version": _VERSION,
        "dtype": _dtype_for(VOCAB_SIZE),
        "vocab_size": VOCAB_SIZE,
        "tokenizer": "bytes",
        "num_tokens": num_tokens,
        "sha256": sha256_file(bin_path),
        "sources": used,
    }
    atomic_write(json_path, lambda f: f.write(json.dumps(header, indent=2).encode()))
    fsync_dir(json_path.parent)
    return _info(bin_path, json_path, header)


def prepare(
    source: str | Path,
    out: str | Path,
    *,
    max_bytes: int | None = None,
    suffixes: Iterable[str] = _DEFAULT_SUFFIXES,
) -> TokenFileInfo:
    """Tokenize a text file or a folder of them (recursively) into ``<out>.bin`` + ``<out>.json``.

    Files are joined with a newline in sorted relative-path order; ``max_bytes`` cuts the total to
    exactly that many tokens. ``out`` may be a prefix or end in ``.bin``.
    """
    files = _collect_files(Path(source), suffixes)
    for file in files:
        _require_text(file)
    return _write_token_file(files, out, max_bytes, source)


def _require_text(file: Path) -> None:
    """Refuse a file that is not UTF-8 text: its bytes would train as tokens all the same,
    and an archive or a binary given by mistake would go unnoticed."""
    data = file.read_bytes()
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(
            f"source {str(file)!r} is not UTF-8 text (byte {error.start} is "
            f"{data[error.start]:#04x}): give text files, or convert this one first "
            f"(iconv -t UTF-8 {_quote(file)})"
        ) from None


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
    files = _collect_files(stdlib, (".py",), _STDLIB_EXCLUDED)
    return _write_token_file(files, prefix, max_bytes, stdlib)


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
        f"tokens cannot be read; to re-create both, {_prepare_fix(prefix)}"
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
    n, vocab, dtype = h.get("num_tokens"), h.get("vocab_size"), h.get("dtype")
    want_dtype = _dtype_for(vocab) if isinstance(vocab, int) else None
    problems = [
        (h.get("format") != _FORMAT, f"is not a {_FORMAT!r} header"),
        (h.get("version") != _VERSION, f"has version {h.get('version')!r}, not {_VERSION}"),
        (not (isinstance(n, int) and n > 0), f"has num_tokens={n!r}, not a positive int"),
        (not (isinstance(vocab, int) and vocab > 0), f"has vocab_size={vocab!r}, not positive"),
        (_too_small(dtype, vocab), f"has vocab_size={vocab!r}, {_too_small(dtype, vocab)}"),
        (dtype != want_dtype, f"has dtype={dtype!r}, expected {want_dtype!r}"),
    ]
    for bad, what in problems:
        if bad:
            raise ValueError(f"{where} {what}; {fix}")
    return h


class TokenDataset:
    """A prepared token file, memory-mapped read-only so every rank shares the page cache."""

    def __init__(self, path: str | Path) -> None:
        """Open ``path`` (the ``.bin``, the ``.json`` or their prefix) after validating it."""
        bin_path, json_path = token_file_pair(path)
        prefix = bin_path.with_name(bin_path.name.removesuffix(".bin"))
        problem = _not_token_file(Path(path), bin_path, json_path)
        if problem is not None:
            raise ValueError(problem)
        header = _read_header(json_path)
        self.info = _info(bin_path, json_path, header)
        if not bin_path.is_file():
            raise ValueError(
                f"token file {str(bin_path)!r} is missing next to its header; "
                f"to re-create both, {_prepare_fix(prefix)}"
            )
        expected = self.info.num_tokens * np.dtype(self.info.dtype).itemsize
        actual = bin_path.stat().st_size
        if actual != expected:
            raise ValueError(
                f"token file {str(bin_path)!r} has {actual} bytes but its header promises "
                f"{expected} (num_tokens={self.info.num_tokens}); the file is truncated or "
                f"stale; to re-create it, {_prepare_fix(prefix)}"
            )
        self.tokens: npt.NDArray[Any] = np.memmap(bin_path, dtype=self.info.dtype, mode="r")

    def __len__(self) -> int:
        return self.info.num_tokens


def load_tokens(path: str | Path) -> TokenDataset:
    """Open a prepared token file; ``path`` may be the ``.bin``, the ``.json`` or the prefix."""
    return TokenDataset(path)
