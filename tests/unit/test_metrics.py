"""Metrics files: what `meshpipe plot` reads from a run, including one a crash cut short."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.training.metrics import MetricsLog, plot_metrics, read_records

RECORDS = [{"step": step, "loss": 5.0 - step} for step in range(3)]


def _write(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def test_a_last_line_cut_short_by_a_crash_is_skipped(tmp_path: Path) -> None:
    lines = [json.dumps(r) for r in RECORDS]
    path = _write(tmp_path / "m.jsonl", [*lines, lines[0][:9]])
    assert read_records(path) == RECORDS


def test_plot_draws_a_file_whose_last_line_was_cut(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="plotting needs matplotlib")
    lines = [json.dumps(r) for r in RECORDS]
    path = _write(tmp_path / "m.jsonl", [*lines, lines[0][:9]])
    plot_metrics(path, tmp_path / "m.png")
    assert (tmp_path / "m.png").stat().st_size > 0


def test_a_bad_line_before_the_last_is_named_with_file_and_line(tmp_path: Path) -> None:
    lines = [json.dumps(r) for r in RECORDS]
    path = _write(tmp_path / "m.jsonl", [lines[0], "{oops", lines[1]])
    with pytest.raises(ValueError, match=r"m\.jsonl, line 2: not a JSON record"):
        read_records(path)


def test_a_line_that_is_not_a_step_record_is_named(tmp_path: Path) -> None:
    path = _write(tmp_path / "m.jsonl", [json.dumps(RECORDS[0]), json.dumps({"step": 1})])
    with pytest.raises(ValueError, match=r"m\.jsonl, line 2: not a step record"):
        read_records(path)


def test_plot_writes_next_to_the_metrics_file_by_default(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="plotting needs matplotlib")
    path = _write(tmp_path / "m.jsonl", [json.dumps(r) for r in RECORDS])
    assert plot_metrics(path) == tmp_path / "m.png"
    assert (tmp_path / "m.png").stat().st_size > 0


def test_plot_names_the_file_it_wrote_and_makes_its_folder(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="plotting needs matplotlib")
    path = _write(tmp_path / "m.jsonl", [json.dumps(r) for r in RECORDS])
    written = plot_metrics(path, tmp_path / "new" / "curve")
    assert written == tmp_path / "new" / "curve.png" and written.is_file()


def test_a_resumed_log_holds_the_kept_records_from_the_moment_it_opens(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(4)))
    kept = [{"step": 0, "loss": 1.0}, {"step": 1, "loss": 1.0}]
    with MetricsLog(total_steps=4, path=path, progress=False, kept=kept) as log:
        assert read_records(path) == kept  # a crash now keeps the history
        log.record(step=2, loss=0.5)
    assert [r["step"] for r in read_records(path)] == [0, 1, 2]


def _lines_as_shown(text: str) -> list[str]:
    """What a terminal shows of each line: the text after its last carriage return."""
    return [line.rsplit("\r", 1)[-1] for line in text.split("\n")]


def test_a_log_line_is_printed_on_its_own_line_above_the_progress_bar(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with MetricsLog(total_steps=3, progress=True) as log:
        log.record(step=0, loss=5.0, tokens_per_s=10.0, bubble=0.5)
        log.say("meshpipe: step 1: loss 5.0000")
        log.record(step=1, loss=4.0, tokens_per_s=10.0, bubble=0.5)
    err = capsys.readouterr().err
    assert "meshpipe: step 1: loss 5.0000" in _lines_as_shown(err)
