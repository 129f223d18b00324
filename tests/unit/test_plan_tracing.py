"""`meshpipe plan` says how much of a search was tracing on fake tensors, which a later search
of the same model reads from disk instead (`engine.cli.plan_report`)."""

from __future__ import annotations

import errno
import json
import re
from pathlib import Path

import pytest

from engine.cli.main import main
from engine.memory import trace_cache
from engine.memory.trace_store import forget_traces

_ARGV = ["plan", "--model", "gpt-tiny", "--devices", "2", "--device-memory", "1GB"]
_ARGV += ["--global-batch", "4", "--seq-len", "32", "--top", "1"]
_TRACED = re.compile(
    r"^\d+\.\d s of it making (\d+) layer traces and (\d+) stage traces on fake tensors, "
    r"once: (.*)$"
)


def _traced_lines(capsys: pytest.CaptureFixture[str]) -> list[re.Match[str]]:
    assert main(_ARGV) == 0
    lines = capsys.readouterr().out.splitlines()
    return [m for m in map(_TRACED.match, lines) if m]


def test_a_first_search_says_what_it_traced_and_that_nothing_was_kept(
    capsys: pytest.CaptureFixture[str],
) -> None:
    forget_traces()  # the test session runs with MESHPIPE_TRACE_CACHE=off
    (line,) = _traced_lines(capsys)
    assert int(line[1]) > 0 and int(line[2]) > 0
    assert line[3] == "not kept (MESHPIPE_TRACE_CACHE=off)"


def test_a_first_search_names_the_folder_it_keeps_its_traces_in(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MESHPIPE_TRACE_CACHE", str(tmp_path))
    forget_traces()
    (line,) = _traced_lines(capsys)
    assert line[3] == f"kept in {tmp_path} for later searches"
    assert any(tmp_path.iterdir())


def test_a_later_search_that_traces_nothing_says_nothing_of_tracing(
    capsys: pytest.CaptureFixture[str],
) -> None:
    forget_traces()
    _traced_lines(capsys)
    assert _traced_lines(capsys) == []  # every trace held by this process now


def test_a_trace_folder_that_cannot_be_written_is_not_called_kept(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocked = tmp_path / "a-file"
    blocked.write_text("not a folder")
    monkeypatch.setenv("MESHPIPE_TRACE_CACHE", str(blocked / "traces"))
    forget_traces()
    (line,) = _traced_lines(capsys)
    assert line[3] == f"not kept ({blocked / 'traces'}: Not a directory)"


def test_traces_a_full_disk_refused_are_not_called_kept(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def full(*_: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setenv("MESHPIPE_TRACE_CACHE", str(tmp_path))
    monkeypatch.setattr(trace_cache.os, "replace", full)
    forget_traces()
    (line,) = _traced_lines(capsys)
    assert line[3] == f"not kept ({tmp_path}: No space left on device)"


def test_traces_some_of_which_were_refused_say_how_many(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = trace_cache.os.replace
    refused: list[str] = []

    def first_trace_refused(source: str, target: Path) -> None:
        if not refused and "trace" in json.loads(Path(source).read_text()):
            refused.append(source)
            raise OSError(errno.EIO, "Input/output error")
        real(source, target)

    monkeypatch.setenv("MESHPIPE_TRACE_CACHE", str(tmp_path))
    monkeypatch.setattr(trace_cache.os, "replace", first_trace_refused)
    forget_traces()
    (line,) = _traced_lines(capsys)
    kept = [f for f in tmp_path.glob("*.json") if "trace" in json.loads(f.read_text())]
    assert kept
    assert line[3] == f"1 of {len(kept) + 1} not kept ({tmp_path}: Input/output error)"
