"""A schedule's in-flight counts kept on disk beside the traces (`SearchContext.counts`):
read back as counted, found by a later search without building the schedule, checked; and
counted ahead in worker processes (`SearchContext.count_ahead`), as a first search does."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

import engine.memory.workers
from engine.config import ParallelConfig
from engine.memory.workers import kept_workers
from engine.plan.candidates import Candidate
from engine.plan.context import SearchContext
from engine.plan.counts import counts_from_payload, counts_payload, stage_counts
from engine.plan.request import PlanRequest
from engine.schedule import (
    SCHEDULES,
    V_SCHEDULES,
    VIRTUAL_SCHEDULES,
    Schedule,
    make_schedule,
    own_placement,
)
from engine.schedule.arrays import ScheduleArrays

_REQUEST = PlanRequest(model="gpt-tiny", devices=4, device_memory=2**30, global_batch=8, seq_len=32)
_context = sys.modules[SearchContext.__module__]


def _per_rank(name: str) -> int:
    return 2 if name in VIRTUAL_SCHEDULES or name in V_SCHEDULES else 1


@pytest.fixture
def on_disk(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[tuple[str, int, int, int]]:
    """The cache in a folder of its own, and every schedule the test builds or counts
    (counted from its rows as arrays: `schedule_arrays`) recorded."""
    monkeypatch.setenv("MESHPIPE_TRACE_CACHE", str(tmp_path))
    made: list[tuple[str, int, int, int]] = []
    built, written = _context.make_schedule, _context.schedule_arrays

    def building(name: str, **sizes: int) -> Schedule:
        made.append((name, sizes["num_ranks"], sizes["micro_batches"], sizes["stages_per_rank"]))
        return built(name, **sizes)

    def writing(*key: Any) -> ScheduleArrays:
        made.append(key)
        return written(*key)

    monkeypatch.setattr(_context, "make_schedule", building)
    monkeypatch.setattr(_context, "schedule_arrays", writing)
    return made


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_counts_read_back_as_counted(name: str) -> None:
    for pp in (2, 3, 4):
        m = 3 * pp
        schedule = make_schedule(
            name, num_ranks=pp, micro_batches=m, stages_per_rank=_per_rank(name)
        )
        counts = stage_counts(schedule)
        payload = json.loads(json.dumps(counts_payload(counts)))
        assert counts_from_payload(payload) == counts, (pp, m)


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_a_schedules_own_placement_is_known_without_building_it(name: str) -> None:
    v = _per_rank(name)
    for pp in (1, 2, 3, 4):
        built = make_schedule(name, num_ranks=pp, micro_batches=2 * pp, stages_per_rank=v)
        assert own_placement(name, pp, v) == built.placement


def test_a_later_search_reads_the_counts_without_building_the_schedule(
    on_disk: list[tuple[str, int, int, int]],
) -> None:
    first = SearchContext(_REQUEST).schedule("zb_v", 2, 16, 2)
    assert on_disk == [("zb_v", 2, 6, 2), ("zb_v", 2, 8, 2)]  # the two samples (3 and 4 a rank)
    later = SearchContext(_REQUEST).schedule("zb_v", 2, 16, 2)
    assert later == first and len(on_disk) == 2


def test_a_counts_file_that_fails_its_checksum_is_counted_again_and_rewritten(
    on_disk: list[tuple[str, int, int, int]], tmp_path: Path
) -> None:
    first = SearchContext(_REQUEST).counts("1f1b", 2, 4, 1)
    (stored,) = tmp_path.glob("*.json")
    body = json.loads(stored.read_text())
    body["counts"]["before"][0] += 1
    stored.write_text(json.dumps(body))
    assert SearchContext(_REQUEST).counts("1f1b", 2, 4, 1) == first
    assert len(on_disk) == 2
    assert json.loads(stored.read_text())["counts"]["before"] == list(first.before)


def test_a_simulation_builds_only_the_schedules_it_runs(
    on_disk: list[tuple[str, int, int, int]],
) -> None:
    SearchContext(_REQUEST).schedule("1f1b", 2, 4, 1)
    later = SearchContext(_REQUEST)
    pipeline = later.schedule("1f1b", 2, 4, 1)
    assert len(on_disk) == 1
    (schedule,) = later.samples(pipeline)
    assert schedule == make_schedule("1f1b", num_ranks=2, micro_batches=4)
    assert len(on_disk) == 2


def _refuse_building(monkeypatch: pytest.MonkeyPatch) -> None:
    def refused(*args: object, **kwargs: object) -> None:
        raise AssertionError("a schedule built or counted in the asking process")

    monkeypatch.setattr(_context, "make_schedule", refused)
    monkeypatch.setattr(_context, "schedule_arrays", refused)


_KEYS = [("1f1b", 2, 4, 1), ("zb_v", 2, 6, 2), ("dualpipe_v", 4, 8, 2), ("v_min", 3, 9, 2)]


def test_counts_made_ahead_in_workers_equal_those_counted_here(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("MESHPIPE_TRACE_CACHE", "off")
    monkeypatch.setenv("MESHPIPE_TRACE_WORKERS", "2")
    here = SearchContext(_REQUEST)
    expected = [here.counts(*key) for key in _KEYS]
    ahead = SearchContext(_REQUEST)
    reports: list[tuple[int, int]] = []
    ahead.count_ahead(_KEYS, progress=lambda done, total: reports.append((done, total)))
    assert reports == [(1, 4), (2, 4), (3, 4), (4, 4)]
    _refuse_building(monkeypatch)
    assert [ahead.counts(*key) for key in _KEYS] == expected


def test_inside_a_search_counts_are_handed_to_the_workers_and_taken_as_asked_for(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`count_ahead` returns at once, the screen's process builds none of them, and each is
    reported as the screen takes it."""
    monkeypatch.setenv("MESHPIPE_TRACE_CACHE", "off")
    monkeypatch.setenv("MESHPIPE_TRACE_WORKERS", "2")
    expected = [SearchContext(_REQUEST).counts(*key) for key in _KEYS]
    ahead = SearchContext(_REQUEST)
    reports: list[tuple[int, int]] = []
    with kept_workers():
        ahead.count_ahead(_KEYS, progress=lambda done, total: reports.append((done, total)))
        assert reports == []
        _refuse_building(monkeypatch)
        assert [ahead.counts(*key) for key in _KEYS] == expected
        ahead.stop_counting()
    assert reports == [(1, 4), (2, 4), (3, 4), (4, 4), (4, 4)]


def test_counts_handed_to_the_workers_and_stopped_are_counted_here_when_asked_for(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("MESHPIPE_TRACE_CACHE", "off")
    monkeypatch.setenv("MESHPIPE_TRACE_WORKERS", "2")
    expected = [SearchContext(_REQUEST).counts(*key) for key in _KEYS]
    ahead = SearchContext(_REQUEST)
    with kept_workers():
        ahead.count_ahead(_KEYS)
        ahead.stop_counting()
        assert [ahead.counts(*key) for key in _KEYS] == expected


def test_counts_held_or_on_disk_are_not_counted_ahead(
    on_disk: list[tuple[str, int, int, int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MESHPIPE_TRACE_WORKERS", "2")
    first = SearchContext(_REQUEST)
    first.count_ahead(_KEYS)
    expected = [first.counts(*key) for key in _KEYS]

    def no_pool(*args: object, **kwargs: object) -> None:
        raise AssertionError("a worker pool for counts already made")

    monkeypatch.setattr(engine.memory.workers, "ProcessPoolExecutor", no_pool)
    _refuse_building(monkeypatch)
    first.count_ahead(_KEYS)  # held by this search
    later = SearchContext(_REQUEST)
    later.count_ahead(_KEYS + _KEYS)  # on disk
    assert [later.counts(*key) for key in _KEYS] == expected


@pytest.mark.parametrize(
    ("schedule", "v", "m"),
    [("1f1b", 1, 2), ("1f1b", 1, 12), ("interleaved_1f1b", 2, 6), ("dualpipe_v", 2, 16)],
)
def test_a_candidates_count_keys_are_every_count_its_screen_reads(
    monkeypatch: pytest.MonkeyPatch, schedule: str, v: int, m: int
) -> None:
    """Its own length or its two samples, and its fewest micro-batches where fewer."""
    monkeypatch.setenv("MESHPIPE_TRACE_CACHE", "off")
    monkeypatch.setenv("MESHPIPE_TRACE_WORKERS", "1")
    c = Candidate(
        mesh=ParallelConfig(pp=2, dp=1, tp=1),
        schedule=schedule,
        stages_per_rank=v,
        micro_batches=m,
        micro_batch_size=1,
    )
    state = SearchContext(_REQUEST)
    state.count_ahead(state.count_keys(c))
    _refuse_building(monkeypatch)
    state.pipeline(c)
    state.floor_pipeline(c)
