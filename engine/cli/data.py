"""`meshpipe data prepare`: text files into a token file."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from engine.training.data import prepare, token_file_pair

__all__ = ["COMMANDS", "add_parsers", "run"]

COMMANDS = ("data",)


def add_parsers(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register `data` and its subcommands on `meshpipe`'s subparsers."""
    data = commands.add_parser("data", help="prepare token files")
    data_commands = data.add_subparsers(dest="data_command", required=True)
    prep = data_commands.add_parser("prepare", help="turn text files into a token file")
    prep.add_argument("source", help="a text file or a folder of them")
    prep.add_argument("--out", required=True, help="output prefix (writes OUT.bin and OUT.json)")
    prep.add_argument("--max-bytes", type=int, default=None, help="cap on the corpus size")


def run(args: argparse.Namespace, argv: Sequence[str]) -> int:
    bin_path, json_path = token_file_pair(args.out)
    if json_path.is_file():  # checkpoints trained on it refuse to resume on new tokens
        print(f"meshpipe: replacing the token file {bin_path}", file=sys.stderr)
    info = prepare(args.source, args.out, max_bytes=args.max_bytes)
    print(f"wrote {info.num_tokens:,} tokens to {info.bin_path} (header {info.json_path})")
    return 0
