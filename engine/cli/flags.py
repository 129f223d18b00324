"""Flags generated from configuration dataclasses: one flag per field, its help the field's
docstring, so a command, its config and their documentation never drift apart.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import itertools
import textwrap
from collections.abc import Sequence
from typing import Any

__all__ = ["add_config_flags", "given_fields"]


def _field_docs(cls: type) -> dict[str, str]:
    """Docstrings written under each field of a dataclass."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, after in itertools.pairwise(body):
        is_doc = isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and is_doc:
            docs[node.target.id] = str(after.value.value)
    return docs


def add_config_flags(
    parser: argparse.ArgumentParser, cls: type, *, omit_defaults: bool = False
) -> None:
    """One flag per field; with `omit_defaults` a flag not given leaves no attribute."""
    docs = _field_docs(cls)
    for field in dataclasses.fields(cls):
        flag = "--" + field.name.replace("_", "-")
        default = argparse.SUPPRESS if omit_defaults else field.default
        if str(field.type) == "bool":
            help_text = f"{docs.get(field.name, '')} (default: off)"
            parser.add_argument(
                flag, dest=field.name, action="store_true", default=default, help=help_text
            )
            continue
        kind: Any = {"int": int, "float": float}.get(str(field.type), str)
        parser.add_argument(
            flag,
            dest=field.name,
            type=kind,
            default=default,
            help=f"{docs.get(field.name, '')} (default: {field.default})",
        )


def given_fields(cls: type, argv: Sequence[str]) -> set[str]:
    """The fields of `cls` a command line sets, even to their default values."""
    parser = argparse.ArgumentParser(add_help=False)
    add_config_flags(parser, cls, omit_defaults=True)
    given, _ = parser.parse_known_args(argv)
    return set(vars(given))
