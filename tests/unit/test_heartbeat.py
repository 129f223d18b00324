"""Heartbeats name the rank that stopped, not the peers that waited for it; the launcher's
folder keeps only what an error names."""

from __future__ import annotations

import json
import time
from pathlib import Path

from engine.comm import heartbeat
from engine.comm.heartbeat import BEAT_S, Beat, Heartbeat, doing, read_beats, stalled, step_begins
from engine.comm.launch import _tidy


def _beat(rank: int, *, state: str = "running", age: float = 0.0, attempt: int = 0) -> Beat:
    return Beat(rank=rank, where=f"stage {rank} of 2", pid=1000 + rank, attempt=attempt,
                step=3, doing="action 1F0", state=state, at=100.0 - age)  # fmt: skip


def test_a_record_says_where_the_rank_is_and_what_it_is_doing(tmp_path: Path) -> None:
    step_begins(4)
    with Heartbeat(tmp_path, rank=2, where="stage 1 of 2, dp replica 0"), doing("the dp sum"):
        time.sleep(3 * BEAT_S)  # the next beat says it
        (beat,) = read_beats(tmp_path)
    assert (beat.rank, beat.where, beat.step, beat.doing) == (
        2, "stage 1 of 2, dp replica 0", 4, "the dp sum")  # fmt: skip
    assert beat.state == "running"
    assert time.time() - beat.at < 5


def test_a_record_ends_failed_with_the_error_that_ended_the_rank(tmp_path: Path) -> None:
    try:
        with Heartbeat(tmp_path, rank=0, where="stage 0 of 2"):
            raise RuntimeError("timed out")
    except RuntimeError:
        pass
    (beat,) = read_beats(tmp_path)
    assert (beat.state, beat.error) == ("failed", "RuntimeError: timed out")


def test_the_activity_noted_inside_a_block_is_restored_after_it() -> None:
    heartbeat.note("action 0F0")
    with doing("closing the engine"):
        assert heartbeat._state["doing"] == "closing the engine"
    assert heartbeat._state["doing"] == "action 0F0"


def test_only_the_newest_attempt_is_read(tmp_path: Path) -> None:
    for rank, attempt in ((0, 1), (1, 0)):
        record = {**_beat(rank, attempt=attempt).__dict__}
        (tmp_path / f"rank-{rank:05d}.json").write_text(json.dumps(record))
    assert [beat.rank for beat in read_beats(tmp_path)] == [0]


def test_the_stale_running_rank_is_stalled_not_the_failed_or_fresh_ones() -> None:
    beats = [_beat(0, state="failed", age=9), _beat(1, age=6), _beat(2, age=0.5)]
    assert [beat.rank for beat in stalled(beats, now=100.0, stale_s=3)] == [1]


def test_a_stalled_rank_is_described_by_rank_stage_step_and_action() -> None:
    text = _beat(1, age=6).describe(100.0)
    assert text == "rank 1 (stage 1 of 2) stopped responding 6.0 s ago at step 4, during action 1F0"


def test_the_launch_folder_keeps_only_the_file_an_error_names(tmp_path: Path) -> None:
    named = tmp_path / "attempt_0" / "0" / "error.json"
    named.parent.mkdir(parents=True)
    named.write_text("{}")
    (tmp_path / "pytorch-errorfile-x.pickle").write_text("")
    (tmp_path / "attempt_0" / "1").mkdir()
    _tidy(str(tmp_path), keep=f"rank 0 failed: boom (its traceback: {named})")
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == [
        "attempt_0", "attempt_0/0", "attempt_0/0/error.json"]  # fmt: skip


def test_the_launch_folder_goes_when_the_error_names_nothing_in_it(tmp_path: Path) -> None:
    folder = tmp_path / "ranks"
    (folder / "attempt_0").mkdir(parents=True)
    (folder / "rank-00000.json").write_text("{}")
    _tidy(str(folder), keep="rank 1 stopped responding")
    assert not folder.exists()
