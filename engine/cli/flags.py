"""Flags generated from configuration sections: one flag per flat name (`engine.config`), its
help the field's docstring and its default the command's own, so a command, its config and
their documentation never drift apart, and `train`, `memory` and `plan` share one vocabulary.
"""

from __future__ import annotations

import argparse
import ast
import functools
import inspect
import itertools
import textwrap
import typing
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from engine.config import FlatField, flat_fields, to_flat

__all__ = ["add_config_flags", "flag_values", "given_fields"]


@functools.cache
def _field_docs(cls: type) -> Mapping[str, str]:
    """Docstrings written under each field of a dataclass, read from its source once per
    process: parsing it per flag made every command's start seconds slower."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, after in itertools.pairwise(body):
        is_doc = isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and is_doc:
            docs[node.target.id] = " ".join(str(after.value.value).split())
    return docs


def _owner(cls: type, flat_field: FlatField) -> type:
    """The dataclass declaring the field: a section of `cls`, or `cls` itself."""
    if flat_field.section is None:
        return cls
    owner: type = typing.get_type_hints(cls)[flat_field.section]
    return owner


def _kind(owner: type, flat_field: FlatField) -> Any:
    """How argparse reads the flag: bool (a switch), int, float, or text."""
    if flat_field.negate:
        return bool
    if flat_field.field.metadata.get("parse") is not None:
        return str
    hint = typing.get_type_hints(owner)[flat_field.field.name]
    return {bool: bool, int: int, float: float}.get(hint, str)


def add_config_flags(
    parser: argparse.ArgumentParser,
    cls: type,
    *,
    omit_defaults: bool = False,
    exclude: Collection[str] = (),
) -> None:
    """One flag per flat name of `cls` (a composite config), defaulting to `cls()`'s values;
    with `omit_defaults` a flag not given leaves no attribute."""
    defaults = to_flat(cls())
    for flat_field in flat_fields(cls):
        if flat_field.name in exclude:
            continue
        owner = _owner(cls, flat_field)
        doc = _field_docs(owner).get(flat_field.field.name, "")
        flag = "--" + flat_field.name.replace("_", "-")
        default = argparse.SUPPRESS if omit_defaults else defaults[flat_field.name]
        kind = _kind(owner, flat_field)
        if kind is bool:
            parser.add_argument(
                flag,
                dest=flat_field.name,
                action="store_true",
                default=default,
                help=f"{doc} (default: off)",
            )
            continue
        parser.add_argument(
            flag,
            dest=flat_field.name,
            type=kind,
            default=default,
            help=f"{doc} (default: {defaults[flat_field.name]})",
        )


def flag_values(cls: type, args: argparse.Namespace) -> dict[str, Any]:
    """The flat settings of `cls` a parsed command line holds."""
    names = {f.name for f in flat_fields(cls)}
    return {name: value for name, value in vars(args).items() if name in names}


def given_fields(cls: type, argv: Sequence[str]) -> set[str]:
    """The flat names of `cls` a command line sets, even to their default values."""
    parser = argparse.ArgumentParser(add_help=False)
    add_config_flags(parser, cls, omit_defaults=True)
    given, _ = parser.parse_known_args(argv)
    return set(vars(given))
