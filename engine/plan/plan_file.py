"""A chosen plan as a file: every setting of its layout under its flat name (the flags of
`meshpipe train` and `meshpipe memory`), what the planner predicted, and a version.

`meshpipe train --plan FILE` and `meshpipe memory --plan FILE` take the settings; a flag given
beside `--plan` that contradicts one is refused by name (`merge_plan`), so nothing runs other
than what was planned.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Any

from engine.config import flat_fields, require
from engine.plan.request import PlanRequest, Prediction, layout_fields

__all__ = [
    "PLAN_VERSION",
    "apply_plan",
    "merge_plan",
    "plan_fields",
    "read_plan",
    "write_plan",
]

PLAN_VERSION = 1
"""Bumped when a field changes meaning; a file of another version is refused."""

_KIND = "meshpipe-plan"


def plan_fields(request: PlanRequest, plan: Prediction) -> dict[str, Any]:
    """The plan's settings by flat name, all of them (none left to a default)."""
    return layout_fields(request, plan.candidate, plan.boundaries)


def write_plan(path: str | Path, request: PlanRequest, plan: Prediction) -> None:
    """The plan's settings and predictions as versioned JSON."""
    document = {
        "kind": _KIND,
        "version": PLAN_VERSION,
        "settings": plan_fields(request, plan),
        "predicted": {
            "step_time_s": plan.step_time,
            "tokens_per_s": plan.tokens_per_s,
            "bubble": plan.bubble,
            "mfu": plan.mfu,
            "rank_peak_bytes": list(plan.rank_peaks),
            "devices": request.devices,
            "device_memory_bytes": request.device_memory,
        },
    }
    Path(path).write_text(json.dumps(document, indent=2) + "\n")


def read_plan(path: str | Path) -> dict[str, Any]:
    """The settings of a plan file, refused with the reason when it is not one."""
    where = f"--plan {path}"
    try:
        document = json.loads(Path(path).read_text())
    except OSError as error:
        raise ValueError(
            f"{where}: cannot read it ({error.strerror}): give a file meshpipe plan --emit wrote"
        ) from None
    except json.JSONDecodeError as error:
        raise ValueError(
            f"{where} is not JSON ({error.msg}, line {error.lineno}): give a file meshpipe "
            "plan --emit wrote"
        ) from None
    require(
        isinstance(document, dict) and document.get("kind") == _KIND,
        f"{where} is not a meshpipe plan: give a file meshpipe plan --emit wrote",
    )
    version = document.get("version")
    require(
        version == PLAN_VERSION,
        f"{where} is a plan of version {version}, this meshpipe reads version {PLAN_VERSION}: "
        "plan again with this meshpipe (meshpipe plan ... --emit FILE)",
    )
    settings = document.get("settings")
    require(isinstance(settings, dict), f"{where} has no settings: plan again with --emit")
    return dict(settings)


def merge_plan(
    settings: Mapping[str, Any],
    flags: Mapping[str, Any],
    given: Collection[str],
    *,
    path: str,
    normalise: Callable[[str, Any], Any],
) -> dict[str, Any]:
    """The flags' settings with the plan's over them; a flag in `given` whose value differs
    from the plan's is refused, naming both (`normalise` puts values in one form)."""
    for name in sorted(given):
        if name not in settings:
            continue
        mine, planned = normalise(name, flags[name]), normalise(name, settings[name])
        flag = "--" + name.replace("_", "-")
        require(
            mine == planned,
            f"{flag} {flags[name]} contradicts --plan {path}, which sets {name} to "
            f"{settings[name]}: drop {flag} or plan again",
        )
    return {**flags, **settings}


def apply_plan(
    cls: type, path: str, flags: Mapping[str, Any], given: Collection[str]
) -> dict[str, Any]:
    """`flags` (the flat settings of config class `cls` a command line holds) under the plan
    at `path`: its settings replace theirs, a contradicting flag in `given` is refused."""
    fields = {f.name: f for f in flat_fields(cls)}

    def normalise(name: str, value: Any) -> Any:
        found = fields.get(name)
        return found.field_value(value) if found is not None else value

    return merge_plan(read_plan(path), flags, given, path=path, normalise=normalise)
