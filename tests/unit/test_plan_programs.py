"""The schedules a search simulates, compiled ahead in its workers (`engine.plan.programs`)."""

from __future__ import annotations

import pytest

import engine.plan.programs
from engine.memory.workers import kept_workers
from engine.plan.programs import Programs
from engine.schedule import compiled_program, make_schedule
from engine.schedule.arrays import ScheduleArrays
from engine.schedule.program import fused_program

_KEYS = [("1f1b", 2, 8, 1), ("zb_v", 2, 6, 2), ("dualpipe_v", 4, 8, 2), ("v_min", 3, 9, 2)]


def _here(key: tuple[str, int, int, int]) -> object:
    """The schedule built and compiled: what a program compiled from its arrays must equal."""
    name, pp, m, v = key
    return compiled_program(make_schedule(name, num_ranks=pp, micro_batches=m, stages_per_rank=v))


def _compiled_here(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """The schedules compiled in this process from now on, from their arrays (a worker forked
    later records in its own copy of the list)."""
    here: list[object] = []

    def recorded(arrays: ScheduleArrays) -> object:
        here.append(arrays)
        return fused_program(arrays)

    monkeypatch.setattr(engine.plan.programs, "fused_program", recorded)
    return here


def test_programs_compiled_ahead_in_workers_equal_those_compiled_here(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("MESHPIPE_TRACE_WORKERS", "2")
    expected = [_here(key) for key in _KEYS]
    here = _compiled_here(monkeypatch)
    with kept_workers():
        programs = Programs()
        programs.ahead(_KEYS)
        assert [programs.of(key) for key in reversed(_KEYS)] == expected[::-1]
    assert here == []


def test_a_program_not_asked_ahead_is_compiled_here(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MESHPIPE_TRACE_WORKERS", "2")
    with kept_workers():
        programs = Programs()
        programs.ahead(_KEYS[:2])
        here = _compiled_here(monkeypatch)
        assert programs.of(_KEYS[3]) == _here(_KEYS[3])  # without waiting for the others
        assert len(here) == 1
        assert programs.of(_KEYS[0]) == _here(_KEYS[0])


def test_stopped_programs_are_compiled_here_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MESHPIPE_TRACE_WORKERS", "2")
    with kept_workers():
        programs = Programs()
        programs.ahead(_KEYS)
        programs.stop()
        here = _compiled_here(monkeypatch)
        assert programs.of(_KEYS[1]) == _here(_KEYS[1])
        assert len(here) == 1


def test_without_workers_nothing_is_compiled_ahead(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MESHPIPE_TRACE_WORKERS", "1")
    programs = Programs()
    here = _compiled_here(monkeypatch)
    programs.ahead(_KEYS)
    assert here == []  # each is compiled when asked for
    assert programs.of(_KEYS[2]) == _here(_KEYS[2]) and len(here) == 1
