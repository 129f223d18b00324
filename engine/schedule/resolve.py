"""The schedule a run executes: a generator by name or a schedule file, checked against the run's
layout and dry-run before any rank starts (a deadlocking schedule would hang every rank).
"""

from __future__ import annotations

from pathlib import Path

from engine.schedule.generators import SCHEDULES, make_schedule
from engine.schedule.passes import add_communication, forward_only
from engine.schedule.placement import placement_name
from engine.schedule.schedule import Schedule
from engine.schedule.simulate import simulate
from engine.schedule.text import load_schedule
from engine.schedule.validate import ScheduleError, validate

__all__ = ["check_fits", "lowered_schedules", "schedule_for"]


def schedule_for(
    name_or_file: str,
    *,
    num_ranks: int,
    micro_batches: int,
    stages_per_rank: int = 1,
    placement: str | None = None,
) -> Schedule:
    """The compute schedule a run executes: a registered generator by name, or a schedule file
    (`meshpipe schedule --out`, or written by hand) checked against the run's layout; with
    `placement`, under that stage placement (`loop` or `v`)."""
    if name_or_file in SCHEDULES:
        return make_schedule(
            name_or_file,
            num_ranks=num_ranks,
            micro_batches=micro_batches,
            stages_per_rank=stages_per_rank,
            placement=placement,
        )
    if not Path(name_or_file).is_file():
        looks_like_a_path = "/" in name_or_file or Path(name_or_file).suffix != ""
        if looks_like_a_path:
            raise ValueError(
                f"schedule file {name_or_file} does not exist: give an existing file "
                f"(meshpipe schedule --out FILE writes one) or one of {', '.join(SCHEDULES)}"
            )
        raise ValueError(
            f"unknown schedule {name_or_file!r}: choose one of {', '.join(SCHEDULES)}, or give "
            "a schedule file (meshpipe schedule --out FILE writes one)"
        )
    loaded = load_schedule(name_or_file)
    own = placement_name(loaded)
    if placement is not None and loaded.num_stages > loaded.num_ranks and own != placement:
        how = own or "by hand"
        raise ValueError(
            f"schedule file {name_or_file} places its stages {loaded.placement} ({how}), not "
            f"by --placement {placement}: drop --placement (a file keeps its own)"
        )
    return check_fits(
        loaded,
        where=f"schedule file {name_or_file}",
        num_ranks=num_ranks,
        micro_batches=micro_batches,
        stages_per_rank=stages_per_rank,
    )


def check_fits(
    schedule: Schedule, *, where: str, num_ranks: int, micro_batches: int, stages_per_rank: int
) -> Schedule:
    """`schedule`, once it is known to be compute-only, built for the run's ranks,
    micro-batches and stages per rank, and free of deadlock (a dry run: a schedule given as
    data would otherwise hang every rank until the timeout); otherwise an error naming
    `where` and the fix."""
    if schedule.lowered:
        raise ValueError(
            f"{where} holds SEND/RECV actions: a run takes compute actions only (F, B, I, W) "
            "and places the communication itself; remove them"
        )
    if schedule.num_ranks != num_ranks:
        raise ValueError(
            f"{where} has {schedule.num_ranks} rank rows but the run has {num_ranks} pipeline "
            f"ranks: use --pp {schedule.num_ranks} or a file for {num_ranks}"
        )
    if schedule.micro_batches != micro_batches:
        raise ValueError(
            f"{where} runs {schedule.micro_batches} micro-batches but the run has "
            f"{micro_batches}: use --micro-batches {schedule.micro_batches}"
        )
    if schedule.num_stages != num_ranks * stages_per_rank:
        raise ValueError(
            f"{where} places {schedule.num_stages} stages on {num_ranks} ranks but the run has "
            f"{stages_per_rank} stage(s) per rank: use --stages-per-rank "
            f"{schedule.num_stages // num_ranks}"
        )
    try:
        simulate(schedule)
    except ScheduleError as error:
        raise ScheduleError(f"{where}: {error}") from error
    return schedule


def lowered_schedules(
    schedule: str | Schedule, *, num_ranks: int, micro_batches: int, stages: int
) -> tuple[Schedule, Schedule]:
    """The training schedule and its forward-only twin for `eval_step`, both lowered (sends
    and receives spelled out) and validated; a schedule given as data is dry-run first."""
    layout = {"num_ranks": num_ranks, "micro_batches": micro_batches, "stages_per_rank": stages}
    compute = (
        check_fits(schedule, where=f"schedule {schedule.name!r}", **layout)
        if isinstance(schedule, Schedule)
        else schedule_for(
            schedule, num_ranks=num_ranks, micro_batches=micro_batches, stages_per_rank=stages
        )
    )
    lowered = add_communication(compute), add_communication(forward_only(compute))
    for each in lowered:
        validate(each)
    return lowered
