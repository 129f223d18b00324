"""Reading token files: a `.bin` of flat tokens and the JSON header that vouches for it (or
nanoGPT's raw `.bin`, read as it is), each checked before a rank trusts it; `data.py` writes
them."""

from __future__ import annotations

import hashlib
import json
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from engine.training.tokenizer import token_dtype

__all__ = [
    "FORMAT",
    "NANOGPT",
    "VERSION",
    "TokenDataset",
    "TokenFileInfo",
    "file_info",
    "load_tokens",
    "quote_path",
    "token_file_pair",
    "tokenizer_path",
]

NANOGPT = "nanogpt:"
"""`--data nanogpt:PATH`: nanoGPT's raw uint16 tokens, no header (the vocabulary from
`--vocab-size`)."""

FORMAT = "meshpipe-tokens"
"""The header's `format` field."""
VERSION = 2
"""The header version written; 2 added the tokenizer file, `eos_id` and `documents`."""
_READS = (1, 2)
"""Header versions read."""


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


def file_info(bin_path: Path, json_path: Path, header: dict[str, Any]) -> TokenFileInfo:
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


def quote_path(path: Path) -> str:
    """`path` as the shell reads it back, for the commands the errors suggest."""
    return shlex.quote(str(path))


def _prepare_fix(prefix: Path) -> str:
    """How to (re)create the token files `prefix`.bin/.json, from the shell and from Python."""
    return (
        f"run `meshpipe data prepare SOURCE --out {quote_path(prefix)}` with SOURCE your text "
        "file or folder (engine.prepare() from Python)"
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


def _raw_fix(bin_path: Path) -> str:
    return (
        f"if it is nanoGPT's raw uint16 tokens, pass --data {NANOGPT}{quote_path(bin_path)} "
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
            f"tokenize it with `meshpipe data prepare {quote_path(given)} --out "
            f"{quote_path(prefix)}`, then pass --data {quote_path(prefix)} (engine.prepare() and "
            "load_tokens() from Python)"
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
        (h.get("format") != FORMAT, f"is not a {FORMAT!r} header"),
        (h.get("version") not in _READS, f"has version {h.get('version')!r}, not {VERSION}"),
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
    info = file_info(bin_path, json_path, _read_header(json_path))
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
