"""The `meshpipe` command: argparse and printing only, one module per command group."""

from engine.cli.main import main

__all__ = ["main"]
