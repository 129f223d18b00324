"""`meshpipe`: the command line. Each command group lives in its own module here (train and
plot, plan, schedule, memory, data, export/import/generate); this one assembles the parser,
dispatches, and turns failures into exit statuses: 2 for bad input, 1 when a rank or the
machine failed, 130 on Ctrl-C.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from types import ModuleType

from engine.cli import checkpoint, data, memory, plan, schedule, train
from engine.cli.train import Interrupted
from engine.comm.launch import RankFailed

__all__ = ["build_parser", "main"]

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


def _subcommand(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    """The parser of subcommand `name`: its usage is the one a mistake in its flags needs."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            found: argparse.ArgumentParser = action.choices[name]
            return found
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
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
