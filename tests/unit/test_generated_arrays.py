"""Each generator's rows written as arrays (`schedule_arrays`) are the rows its schedules
hold: the planner counts and compiles them without building a single action."""

from __future__ import annotations

import numpy as np
import pytest

from engine.schedule import SCHEDULES, V_SCHEDULES, VIRTUAL_SCHEDULES, compiled_program
from engine.schedule.arrays import read_arrays
from engine.schedule.generated_arrays import ARRAY_GENERATORS, schedule_arrays
from engine.schedule.generators import make_schedule
from engine.schedule.program import fused_program

_FIELDS = ("rank", "position", "kind", "stage", "micro_batch", "starts")


def _sizes(name: str) -> list[tuple[int, int, int]]:
    """Ranks 1-8, micro-batches 1-20 and two longer steps, every v a generator takes up to 4,
    where the generator accepts them."""
    per_rank = (2, 3, 4) if name in VIRTUAL_SCHEDULES else (2,) if name in V_SCHEDULES else (1,)
    found = []
    for p in range(1, 9):
        for m in [*range(1, 21), 37, 64]:
            for v in per_rank:
                try:
                    make_schedule(name, num_ranks=p, micro_batches=m, stages_per_rank=v)
                except ValueError:
                    continue
                found.append((p, m, v))
    return found


def _assert_same_rows(name: str, p: int, m: int, v: int) -> None:
    built = read_arrays(make_schedule(name, num_ranks=p, micro_batches=m, stages_per_rank=v))
    written = schedule_arrays(name, p, m, v)
    assert (written.placement, written.micro_batches) == (built.placement, built.micro_batches)
    for field in _FIELDS:
        ours, theirs = getattr(written.flat, field), getattr(built.flat, field)
        assert ours.dtype == theirs.dtype and np.array_equal(ours, theirs), (p, m, v, field)


@pytest.mark.parametrize("name", sorted(ARRAY_GENERATORS))
def test_a_generators_arrays_are_its_schedules_rows(name: str) -> None:
    for p, m, v in _sizes(name):
        _assert_same_rows(name, p, m, v)


def test_every_generator_is_written_as_arrays() -> None:
    assert set(ARRAY_GENERATORS) == set(SCHEDULES)


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_a_program_compiled_from_the_arrays_is_the_schedules_own(name: str) -> None:
    for p, m, v in _sizes(name)[::5]:
        built = make_schedule(name, num_ranks=p, micro_batches=m, stages_per_rank=v)
        assert fused_program(schedule_arrays(name, p, m, v)) == compiled_program(built)


@pytest.mark.parametrize(
    ("name", "p", "m", "v", "says"),
    [
        ("1f1b", 2, 4, 2, "one stage per rank"),
        ("looped_bfs", 2, 4, 1, "stages-per-rank 2"),
        ("interleaved_1f1b", 2, 3, 2, "multiple of the pipeline ranks"),
        ("gpipe", 2, 0, 1, "at least 1 micro-batch"),
        ("dualpipe_v", 4, 6, 2, "at least as many micro-batches as stages"),
        ("zb_v", 2, 4, 1, "two stages per rank"),
        ("zb_h1", 0, 4, 1, "at least 1 rank"),
    ],
)
def test_sizes_a_generator_refuses_are_refused_with_its_error(
    name: str, p: int, m: int, v: int, says: str
) -> None:
    with pytest.raises(ValueError, match=says):
        schedule_arrays(name, p, m, v)
