"""`meshpipe`: the command line. Each command group lives in its own module here (train and
plot, plan, schedule, memory, data, export/import/generate); this one assembles the parser,
dispatches, and turns failures into exit statuses: 2 for bad input, 1 when a rank or the
machine failed, 130 on Ctrl-C.

The deepspeed launcher (and `torch.distributed.launch`) add `--local_rank=N` to every rank's
command line, *before* the subcommand; it is taken out of the line wherever it stands, whatever
the subcommand, and its value reaches the run through `LOCAL_RANK` as under torchrun.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
from collections.abc import Sequence
from types import ModuleType

from engine.cli import checkpoint, data, memory, plan, schedule, train
from engine.cli.train import Interrupted
from engine.comm.launch import RankFailed

__all__ = ["LOCAL_RANK_FLAGS", "build_parser", "entry", "main", "without_local_rank"]

_GROUPS: tuple[ModuleType, ...] = (train, plan, schedule, memory, data, checkpoint)
"""Every command group: each has `COMMANDS`, `add_parsers(commands)` and `run(args, argv)`."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="meshpipe", description="Pipeline-parallel training of decoder LLMs."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    for group in _GROUPS:
        group.add_parsers(commands)
    return parser


LOCAL_RANK_FLAGS = ("--local_rank", "--local-rank")
"""What launchers add to each rank's command line: `--local_rank=N` (deepspeed) or
`--local-rank N`."""


def _local_rank_value(flag: str, value: str | None) -> str:
    if value is None or not value.isdigit():
        raise ValueError(
            f"{flag} takes the rank's index on its host, a number such as {flag}=0 (got "
            f"{value!r}): the deepspeed launcher adds it; started by hand, leave it out"
        )
    return value


def without_local_rank(argv: Sequence[str]) -> tuple[list[str], str | None]:
    """`argv` without the launcher's `--local_rank` (`=N` or ` N`, either spelling, anywhere),
    and its value (None when absent)."""
    rest: list[str] = []
    found: str | None = None
    words = iter(argv)
    for word in words:
        flag, equals, value = word.partition("=")
        if flag not in LOCAL_RANK_FLAGS:
            rest.append(word)
            continue
        found = _local_rank_value(flag, value if equals else next(words, None))
    return rest, found


def _take_local_rank(argv: Sequence[str]) -> list[str]:
    """The command line without the launcher's flag; its value becomes `LOCAL_RANK` where the
    launcher did not set that too (the old `torch.distributed.launch`)."""
    rest, local_rank = without_local_rank(argv)
    if local_rank is not None:
        os.environ.setdefault("LOCAL_RANK", local_rank)
    return rest


def _subcommand(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    """The parser of subcommand `name`: its usage is the one a mistake in its flags needs."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            found: argparse.ArgumentParser = action.choices[name]
            return found
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        argv = _take_local_rank(sys.argv[1:] if argv is None else argv)
    except ValueError as error:
        parser.exit(2, f"meshpipe: error: {error}\n")
    args, extra = parser.parse_known_args(argv)
    if extra:
        _subcommand(parser, args.command).error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        group = next(g for g in _GROUPS if args.command in g.COMMANDS)
        result: int = group.run(args, argv)
        return result
    except ValueError as error:
        parser.exit(2, f"meshpipe: error: {error}\n")
    except RankFailed as error:
        parser.exit(2 if error.bad_input else 1, f"meshpipe: error: {error}\n")
    except OSError as error:
        parser.exit(1, f"meshpipe: error: {error}\n")
    except Interrupted as interrupted:
        parser.exit(130, f"meshpipe: {interrupted}\n")
    except KeyboardInterrupt:
        parser.exit(130, "meshpipe: interrupted\n")


def entry() -> None:
    """The `meshpipe` console script: `main`, then an exit that spares the garbage collector's
    final passes over the millions of objects torch's modules hold (5 s of a busy 2-core
    machine, 0.5 s frozen), so a failed run returns when its error is printed. Not for
    in-process callers, whose later garbage frozen objects would keep alive."""
    try:
        status = main()
    finally:
        gc.freeze()
    sys.exit(status)
