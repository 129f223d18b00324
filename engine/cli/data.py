"""`meshpipe data prepare | train-tokenizer`: text into a token file, and a BPE tokenizer
trained on it."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from engine.training.data import prepare, token_file_pair
from engine.training.paths import check_paths, file_in, token_file
from engine.training.preflight import writable_folder
from engine.training.sources import DEFAULT_SUFFIXES, collect_files, documents
from engine.training.tokenizer import BYTES, train_tokenizer

__all__ = ["COMMANDS", "add_parsers", "run"]

COMMANDS = ("data",)


def add_parsers(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register `data` and its subcommands on `meshpipe`'s subparsers."""
    data = commands.add_parser("data", help="prepare token files")
    data_commands = data.add_subparsers(dest="data_command", required=True)
    prep = data_commands.add_parser("prepare", help="turn text files into a token file")
    prep.add_argument("source", help="a text, JSON-lines or Parquet file, or a folder of them")
    prep.add_argument("--out", required=True, help="output prefix (writes OUT.bin and OUT.json)")
    prep.add_argument("--max-bytes", type=int, default=None, help="cap on the corpus size")
    prep.add_argument(
        "--tokenizer",
        default=BYTES,
        help="`bytes` (vocab 256), a tokenizer.json, or a Hugging Face folder holding one",
    )
    _text_field(prep)
    train = data_commands.add_parser(
        "train-tokenizer", help="train a byte-level BPE tokenizer (GPT-2's kind) on text"
    )
    train.add_argument("source", help="a text, JSON-lines or Parquet file, or a folder of them")
    train.add_argument("--vocab-size", type=int, required=True, help="tokens, EOS included")
    train.add_argument("--out", required=True, help="folder for tokenizer.json")
    _text_field(train)


def _text_field(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--text-field", default="text", help="the field of JSON lines or Parquet with the text"
    )


def _check_out(source: str, out: str) -> None:
    """--out is neither the source nor a folder, and its folder can be written."""
    reads = [file_in("SOURCE", source)] if Path(source).is_file() else []
    check_paths([*reads, token_file("--out", out, output=True)])
    for path in token_file_pair(out):
        if path.is_dir():
            raise ValueError(f"--out {out}: {path} is a folder: give another prefix")
    writable_folder(token_file_pair(out)[0].parent, "--out", out)


def _io_failure(error: OSError, source: str, out: str) -> str:
    """The flag and the file of a failed read or write, with the system's reason."""
    name = Path(str(error.filename or ""))
    written = [p.name for p in token_file_pair(out)]
    if any(name.name in (w, f".{w}") or name.name.startswith(f".{w}.") for w in written):
        return f"--out {out}: cannot write {name} ({error.strerror}): give another --out"
    return f"SOURCE {source}: cannot read {name} ({error.strerror})"


def _train_tokenizer(args: argparse.Namespace) -> int:
    if Path(args.out).is_file():
        raise ValueError(f"--out {args.out} is a file: give a folder for tokenizer.json")
    files = collect_files(Path(args.source), DEFAULT_SUFFIXES)
    texts = (
        d.content.decode("utf-8", errors="replace") if isinstance(d.content, bytes) else d.content
        for d in documents(files, args.text_field)
    )
    trained = train_tokenizer(texts, args.vocab_size, args.out)
    print(
        f"wrote {Path(args.out) / 'tokenizer.json'} ({trained.vocab_size:,} tokens, end of text "
        f"{trained.eos_id}); use it with `meshpipe data prepare SOURCE --tokenizer {args.out}`"
    )
    return 0


def run(args: argparse.Namespace, argv: Sequence[str]) -> int:
    if args.data_command == "train-tokenizer":
        return _train_tokenizer(args)
    _check_out(args.source, args.out)
    bin_path, json_path = token_file_pair(args.out)
    if json_path.is_file():  # checkpoints trained on it refuse to resume on new tokens
        print(f"meshpipe: replacing the token file {bin_path}", file=sys.stderr)
    try:
        info = prepare(
            args.source,
            args.out,
            max_bytes=args.max_bytes,
            tokenizer=args.tokenizer,
            text_field=args.text_field,
        )
    except OSError as error:
        raise OSError(_io_failure(error, args.source, args.out)) from None
    print(f"wrote {info.num_tokens:,} tokens to {info.bin_path} (header {info.json_path})")
    if info.eos_id is None and args.tokenizer != BYTES:
        print(
            f"meshpipe: {args.tokenizer} has no end-of-text token: documents follow each "
            "other unseparated",
            file=sys.stderr,
        )
    return 0
