"""Schedule files, timeline plots, traces and the `meshpipe schedule` command."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.actions import format_actions
from engine.cli import main
from engine.passes import add_communication
from engine.schedules import interleaved_1f1b, make_schedule, zb_h1
from engine.simulate import simulate
from engine.timeline import chrome_trace, load_schedule, plot_timeline, save_schedule
from engine.validate import ScheduleError


@pytest.mark.parametrize("fmt", ["csv", "text"])
def test_saved_schedule_loads_back_equal(fmt: str, tmp_path: Path) -> None:
    schedule = interleaved_1f1b(2, 4, 2)
    save_schedule(schedule, tmp_path / "s", fmt=fmt)
    assert load_schedule(tmp_path / "s") == schedule


def test_lowered_schedule_round_trips(tmp_path: Path) -> None:
    schedule = add_communication(zb_h1(2, 3))
    save_schedule(schedule, tmp_path / "s.csv")
    assert load_schedule(tmp_path / "s.csv") == schedule


def test_plain_rows_without_header_load_with_loop_placement(tmp_path: Path) -> None:
    (tmp_path / "mine.txt").write_text("0F0 0F1 0B0 0B1\n1F0 1B0 1F1 1B1\n")
    schedule = load_schedule(tmp_path / "mine.txt")
    assert (schedule.num_stages, schedule.micro_batches, schedule.placement) == (2, 2, (0, 1))


def test_a_broken_custom_schedule_is_rejected_on_load(tmp_path: Path) -> None:
    (tmp_path / "bad.txt").write_text("0B0 0F0\n1F0 1B0\n")
    with pytest.raises(ScheduleError, match="0B0 at index 0 comes before its 0F0"):
        load_schedule(tmp_path / "bad.txt")


def test_empty_schedule_file_is_rejected(tmp_path: Path) -> None:
    (tmp_path / "empty.txt").write_text("# nothing\n")
    with pytest.raises(ValueError, match="holds no actions"):
        load_schedule(tmp_path / "empty.txt")


def test_timeline_plot_is_written(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    plot_timeline(simulate(zb_h1(2, 4)), tmp_path / "t.png", title="zb_h1")
    assert (tmp_path / "t.png").read_bytes()[:4] == b"\x89PNG"


def test_chrome_trace_has_a_track_per_rank_and_a_slice_per_action(tmp_path: Path) -> None:
    chrome_trace([[("0F0", 0.0, 0.5)], [("1F0", 0.5, 1.0), ("1B0", 1.0, 2.0)]], tmp_path / "t.json")
    events = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    slices = [e for e in events if e["ph"] == "X"]
    assert [(e["name"], e["tid"], e["dur"]) for e in slices] == [
        ("0F0", 0, 500000.0),
        ("1F0", 1, 500000.0),
        ("1B0", 1, 1000000.0),
    ]


def test_schedule_command_prints_grid_bubble_and_peaks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "s.csv"
    argv = ["schedule", "--schedule", "zb_h1", "--pp", "2", "--micro-batches", "3"]
    assert main([*argv, "--format", "csv", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert format_actions(zb_h1(2, 3).rows[0]) in text
    assert "bubble" in text and "activation peak per stage:  [2, 2]" in text
    assert load_schedule(out) == make_schedule("zb_h1", num_ranks=2, micro_batches=3)


def test_schedule_command_rejects_unparsable_costs(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["schedule", "--costs", "fast,slow"])
    assert "give F,B,I,W or F,B,I,W,comm" in capsys.readouterr().err
