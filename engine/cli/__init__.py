"""The `meshpipe` command: argparse and printing only, one module per command group.

`engine.cli.main:entry` (`main`, then a quick exit) is the console script; `python -m
engine.cli …` runs it too (what torchrun and the deepspeed launcher start on every rank).
"""

__all__: list[str] = []
