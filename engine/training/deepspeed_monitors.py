"""The DeepSpeed config sections that say what a run reports, read into meshpipe's own
outputs: `tensorboard`, `csv_monitor` and `wandb` into its metric writers, `flops_profiler` into
its FLOPs report, `steps_per_print` and `wall_clock_breakdown` into its log lines. Nothing here
changes what is computed; a key meshpipe cannot report as DeepSpeed would is refused by name.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from engine.config import require
from engine.config.engine_options import parse_stages
from engine.training.deepspeed_sections import (
    Handler,
    Refusals,
    check_known,
    number,
    refuse_values,
    section_of,
)

__all__ = ["MONITOR_HANDLERS", "check_recompute_fwd_factor"]


def _monitor_dir(value: Any, key: str) -> str | None:
    """Where DeepSpeed's tensorboard / csv_monitor write: output_path/job_name."""
    section = section_of(value, key)
    check_known(section, ("enabled", "output_path", "job_name"), key)
    if not section.get("enabled", False):
        return None
    return os.path.join(section.get("output_path", ""), section.get("job_name", "DeepSpeedJobName"))


def _tensorboard(value: Any, config: Mapping[str, Any]) -> dict[str, Any]:
    where = _monitor_dir(value, "tensorboard")
    return {} if where is None else {"tensorboard_dir": where}


def _csv_monitor(value: Any, config: Mapping[str, Any]) -> dict[str, Any]:
    where = _monitor_dir(value, "csv_monitor")
    return {} if where is None else {"csv_dir": where}


def _wandb(value: Any, config: Mapping[str, Any]) -> dict[str, Any]:
    section = section_of(value, "wandb")
    check_known(section, ("enabled", "group", "team", "project"), "wandb")
    if not section.get("enabled", False):
        return {}
    offline = "an offline run has no team: remove it (`wandb sync --entity TEAM` syncs)"
    refuse_values(section, {"team": (None, offline)}, "wandb")
    return {
        "wandb_project": section.get("project", "deepspeed"),
        "wandb_group": section.get("group"),
    }


_PROFILER_KEYS = ("enabled", "recompute_fwd_factor", "profile_step", "module_depth",
                  "top_modules", "detailed", "output_file")  # fmt: skip
_TREE = "meshpipe reports per stage and per layer, not DeepSpeed's tree of modules"
_PROFILER_REFUSED: Refusals = {
    "module_depth": (-1, f"{_TREE}: remove it (or give DeepSpeed's default, -1)"),
    "top_modules": (1, f"{_TREE}: remove it (or give DeepSpeed's default, 1)"),
    "detailed": (True, f"{_TREE}, always in full: remove it (or give true)"),
}


def _flops_profiler(value: Any, config: Mapping[str, Any]) -> dict[str, Any]:
    """DeepSpeed profiles the step that starts after `profile_step` optimizer steps (its
    global_steps counts steps done, from 0): meshpipe's step profile_step + 1, counted from 1.
    recompute_fwd_factor is checked against the run's recomputation by
    `check_recompute_fwd_factor`."""
    section = section_of(value, "flops_profiler")
    check_known(section, _PROFILER_KEYS, "flops_profiler")
    if not section.get("enabled", False):
        return {}
    refuse_values(section, _PROFILER_REFUSED, "flops_profiler")
    key = "flops_profiler.profile_step"
    step = number(section.get("profile_step", 1), key, int)
    require(step >= 0, f"{key}={step}: give the number of steps done before the profiled one")
    fields: dict[str, Any] = {"flops_profile_step": step + 1}
    if section.get("output_file"):  # DeepSpeed prints to stdout for null and ""
        fields["flops_profile_file"] = str(section["output_file"])
    return fields


def _recompute_share(settings: Mapping[str, Any]) -> tuple[float | None, str]:
    """The share of the forward FLOPs the run recomputes, when it does not depend on the
    partition (None when only some stages recompute), and how the settings say it."""
    recompute = str(settings.get("recompute", "none"))
    if recompute == "none":
        return 0.0, "--recompute none"
    num_stages = int(settings.get("pp", 1)) * int(settings.get("stages_per_rank", 1))
    stages = settings.get("recompute_stages")
    if stages is None or set(parse_stages(stages)) >= set(range(num_stages)):
        return 1.0, f"--recompute {recompute} on every stage"
    listed = ",".join(map(str, parse_stages(stages)))
    return None, f"--recompute {recompute} on stages {listed} only"


def check_recompute_fwd_factor(config: Mapping[str, Any], settings: Mapping[str, Any]) -> None:
    """An enabled profiler's recompute_fwd_factor (DeepSpeed's user-supplied share of the
    forward recomputed) must be what the run's flat `settings` recompute: meshpipe counts each
    recomputed layer exactly, so a different share is refused naming both."""
    section = config.get("flops_profiler")
    if not isinstance(section, Mapping) or not section.get("enabled", False):
        return
    if "recompute_fwd_factor" not in section:
        return
    key = "flops_profiler.recompute_fwd_factor"
    given = number(section["recompute_fwd_factor"], key)
    share, how = _recompute_share(settings)
    require(
        share is not None,
        f"{key}={given:g} cannot describe {how}: the recomputed share of the forward then "
        "depends on the partition, and meshpipe's FLOPs report counts each recomputed layer "
        "exactly: remove recompute_fwd_factor",
    )
    require(
        given == share,
        f"{key}={given:g} contradicts the run's {how} (a share of {share:g} of the forward "
        f"recomputed, which meshpipe's FLOPs report counts exactly): give {share:g} or remove it",
    )


def _steps_per_print(value: Any, config: Mapping[str, Any]) -> dict[str, Any]:
    steps = number(value, "steps_per_print", int)
    require(steps >= 1, f"steps_per_print={steps}: give a number of steps of at least 1")
    return {"log_every": steps}


def _wall_clock_breakdown(value: Any, config: Mapping[str, Any]) -> dict[str, Any]:
    require(isinstance(value, bool), f"wall_clock_breakdown={value!r}: give true or false")
    return {"log_phases": value}


MONITOR_HANDLERS: dict[str, Handler] = {
    "tensorboard": _tensorboard,
    "csv_monitor": _csv_monitor,
    "wandb": _wandb,
    "flops_profiler": _flops_profiler,
    "steps_per_print": _steps_per_print,
    "wall_clock_breakdown": _wall_clock_breakdown,
}
"""The top-level keys of what a run reports, honoured section by section."""
