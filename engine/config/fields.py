"""The one configuration vocabulary: per-concern sections whose fields are also flat names.

A run's configuration is a handful of frozen sections (model, parallelism, schedule,
partition, batch, engine options, optimizer, learning rate, data, checkpoints, run). Each
field has one flat name, unique across sections: the `meshpipe` flag (`--seq-len`), the key a
DeepSpeed JSON maps to and the key in a checkpoint's `trainer.json`. Most flat names are the
field's own name; `flat(...)` metadata renames one (OptimizerSpec's `eps` is `adam_eps`),
negates a switch (`nonfinite_guard` is `--no-nonfinite-guard`) or gives its text form (betas
as `0.9,0.95`). `to_flat` and `from_flat` convert whole configs both ways, so the CLI, the
DeepSpeed mapping and the checkpoint never keep a second copy of a field.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["FlatField", "flat", "flat_fields", "from_flat", "replace_flat", "require", "to_flat"]


def require(ok: bool, message: str) -> None:
    """Raise the configuration's one kind of error (a ValueError) unless `ok`."""
    if not ok:
        raise ValueError(message)


def flat(
    name: str | None = None,
    *,
    negate: bool = False,
    parse: Callable[[Any], Any] | None = None,
    text: Callable[[Any], Any] | None = None,
) -> dict[str, Any]:
    """Field metadata: its flat `name` when not the field's own, `negate` for a switch whose
    flag says the opposite, `parse` from the flat form and `text` back to it."""
    return {"flat": name, "negate": negate, "parse": parse, "text": text}


@dataclass(frozen=True)
class FlatField:
    """One section field seen by its flat name."""

    section: str | None
    """Attribute of the composite config holding the section (None: the composite's own)."""
    field: dataclasses.Field[Any]
    name: str
    """The flat name: flag `--{name with dashes}`, DeepSpeed mapping key, trainer.json key."""

    @property
    def negate(self) -> bool:
        return bool(self.field.metadata.get("negate", False))

    def flat_value(self, value: Any) -> Any:
        """The field's value in its flat form."""
        if self.negate:
            return not value
        text = self.field.metadata.get("text")
        return text(value) if text is not None and value is not None else value

    def field_value(self, value: Any) -> Any:
        """A flat value in the field's own form."""
        if self.negate:
            return not value
        parse = self.field.metadata.get("parse")
        return parse(value) if parse is not None and value is not None else value


def flat_fields(cls: type) -> Iterator[FlatField]:
    """Every flat field of a composite config class (its sections' fields, then its own) or
    of a single section class."""
    hints = _resolved_types(cls)
    for field in dataclasses.fields(cls):
        kind = hints[field.name]
        if dataclasses.is_dataclass(kind):
            for inner in dataclasses.fields(kind):
                yield FlatField(field.name, inner, inner.metadata.get("flat") or inner.name)
        else:
            yield FlatField(None, field, field.metadata.get("flat") or field.name)


def _resolved_types(cls: type) -> dict[str, Any]:
    """Field types as classes (the modules use postponed annotations)."""
    return typing.get_type_hints(cls)


def to_flat(config: Any) -> dict[str, Any]:
    """A composite config (or one section) as {flat name: flat value}."""
    values: dict[str, Any] = {}
    for flat_field in flat_fields(type(config)):
        holder = config if flat_field.section is None else getattr(config, flat_field.section)
        values[flat_field.name] = flat_field.flat_value(getattr(holder, flat_field.field.name))
    return values


def from_flat(cls: type, values: Mapping[str, Any]) -> Any:
    """Build a composite config class (or one section) from flat names; a flat name left out
    keeps the value of `cls()`, the class's defaults (a composite may choose other defaults
    than its sections'). An unknown name is refused, naming it."""
    fields = list(flat_fields(cls))
    known = {f.name for f in fields}
    unknown = sorted(set(values) - known)
    require(not unknown, f"unknown settings {unknown} for {cls.__name__}: use {sorted(known)}")
    changes: dict[str | None, dict[str, Any]] = {}
    for flat_field in fields:
        if flat_field.name in values:
            value = flat_field.field_value(values[flat_field.name])
            changes.setdefault(flat_field.section, {})[flat_field.field.name] = value
    defaults = cls()
    built = dict(changes.pop(None, {}))
    for name, kwargs in changes.items():
        assert name is not None
        built[name] = dataclasses.replace(getattr(defaults, name), **kwargs)
    return dataclasses.replace(defaults, **built)


def replace_flat(config: Any, **changes: Any) -> Any:
    """A copy of a composite config with some settings changed, by their flat names."""
    return from_flat(type(config), {**to_flat(config), **changes})
