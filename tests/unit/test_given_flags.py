"""`engine.cli.flags.given_fields` reads which config fields a command line sets with a parser
of the config's flags alone, which (as argparse does by default) takes a unique prefix of a
flag for the flag. A command's other flag that is a prefix of a config flag would be read as
that config flag: `--gpu X` as `--gpus-per-node X`. No command may have one."""

import argparse

import pytest

from engine.cli.flags import add_config_flags
from engine.cli.main import build_parser
from engine.memory.estimate import MemoryConfig
from engine.plan import Hardware
from engine.training.config import TrainConfig


def _long_options(parser: argparse.ArgumentParser) -> set[str]:
    return {o for action in parser._actions for o in action.option_strings if o.startswith("--")}


def _command(name: str) -> argparse.ArgumentParser:
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return commands.choices[name]


@pytest.mark.parametrize(
    ("command", "config"), [("train", TrainConfig), ("memory", MemoryConfig), ("plan", Hardware)]
)
def test_no_other_flag_of_a_command_is_a_prefix_of_its_configs_flags(
    command: str, config: type
) -> None:
    fields = argparse.ArgumentParser(add_help=False)
    add_config_flags(fields, config, omit_defaults=True)
    config_flags = _long_options(fields)
    others = _long_options(_command(command)) - config_flags
    clashes = {o: [f for f in config_flags if f.startswith(o)] for o in others}
    assert {o: f for o, f in clashes.items() if f} == {}
