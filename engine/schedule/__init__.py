"""Schedules as data: actions, generators, text and file forms, lowering, validation,
simulation and plots.

Nothing here imports torch.distributed: a schedule is plain data that every other layer reads.
"""

from engine.schedule.actions import Action, ActionKind, split_units
from engine.schedule.generators import (
    SCHEDULES,
    VIRTUAL_SCHEDULES,
    gpipe,
    inference,
    interleaved_1f1b,
    looped_bfs,
    make_schedule,
    one_f_one_b,
    own_placement,
    placed,
    zb_drain,
    zb_h1,
    zb_h2,
)
from engine.schedule.passes import add_communication, forward_only
from engine.schedule.placement import PLACEMENTS, placement_of
from engine.schedule.program import (
    Program,
    SimTimes,
    compiled_program,
    program_times,
    simulate_times,
)
from engine.schedule.resolve import check_fits, schedule_for
from engine.schedule.schedule import Schedule, format_schedule
from engine.schedule.shared_cores import shared_program_times, shared_timeline
from engine.schedule.simulate import ActionCosts, SimResult, simulate, steady_state_bubble
from engine.schedule.text import load_schedule, parse_schedule, save_schedule
from engine.schedule.v_schedules import V_SCHEDULES, dualpipe_v, v_half, v_min, zb_v
from engine.schedule.validate import ScheduleError, validate

__all__ = [
    "PLACEMENTS",
    "SCHEDULES",
    "VIRTUAL_SCHEDULES",
    "V_SCHEDULES",
    "Action",
    "ActionCosts",
    "ActionKind",
    "Program",
    "Schedule",
    "ScheduleError",
    "SimResult",
    "SimTimes",
    "add_communication",
    "check_fits",
    "compiled_program",
    "dualpipe_v",
    "format_schedule",
    "forward_only",
    "gpipe",
    "inference",
    "interleaved_1f1b",
    "load_schedule",
    "looped_bfs",
    "make_schedule",
    "one_f_one_b",
    "own_placement",
    "parse_schedule",
    "placed",
    "placement_of",
    "program_times",
    "save_schedule",
    "schedule_for",
    "shared_program_times",
    "shared_timeline",
    "simulate",
    "simulate_times",
    "split_units",
    "steady_state_bubble",
    "v_half",
    "v_min",
    "validate",
    "zb_drain",
    "zb_h1",
    "zb_h2",
    "zb_v",
]
