"""Stage traces kept on disk (`engine.memory.trace_cache`): found again, checked, refreshed."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from engine.memory import trace_cache
from engine.memory.replay import StageShape
from engine.memory.trace_store import cached_trace, forget_traces
from models import layer_specs

_SHAPE = StageShape(
    micro_batches=2,
    micro_batch_size=1,
    seq_len=8,
    hidden=64,
    divisor=2,
    precision="fp32",
    recompute="none",
)
_ARGS = (tuple(layer_specs("gpt-tiny")[1:2]), False, False, (False,), _SHAPE, "cpu")
_traces = sys.modules[cached_trace.__module__]


@pytest.fixture
def traced(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[object]:
    """The cache in a folder of its own, and every real trace the test runs recorded."""
    monkeypatch.setenv("MESHPIPE_TRACE_CACHE", str(tmp_path))
    forget_traces()
    made: list[object] = []
    real = _traces.trace_stage

    def recording(*args: object, **kwargs: object) -> object:
        made.append(real(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(_traces, "trace_stage", recording)
    yield made
    forget_traces()


def test_a_trace_is_found_on_disk_by_a_later_run(traced: list[object]) -> None:
    first = cached_trace(*_ARGS)
    forget_traces()  # a new process: only the disk remembers
    assert cached_trace(*_ARGS) == first
    assert len(traced) == 1


def test_a_file_that_fails_its_checksum_is_traced_again_and_rewritten(
    traced: list[object], tmp_path: Path
) -> None:
    first = cached_trace(*_ARGS)
    (stored,) = tmp_path.glob("*.json")
    body = json.loads(stored.read_text())
    body["trace"]["sent_back"] += 1
    stored.write_text(json.dumps(body))
    forget_traces()
    assert cached_trace(*_ARGS) == first
    assert len(traced) == 2
    assert json.loads(stored.read_text())["trace"]["sent_back"] == first.sent_back


def test_other_code_reads_other_names(
    traced: list[object], monkeypatch: pytest.MonkeyPatch
) -> None:
    cached_trace(*_ARGS)
    forget_traces()
    monkeypatch.setattr(trace_cache, "_code_digest", lambda: "another meshpipe")
    cached_trace(*_ARGS)
    assert len(traced) == 2


def test_off_keeps_nothing(
    traced: list[object], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("MESHPIPE_TRACE_CACHE", "off")
    cached_trace(*_ARGS)
    forget_traces()
    cached_trace(*_ARGS)
    assert len(traced) == 2 and not list(tmp_path.iterdir())


def test_the_default_folder_is_the_meshpipe_caches(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MESHPIPE_TRACE_CACHE")
    monkeypatch.setenv("MESHPIPE_CACHE", "/data/cache")
    assert trace_cache.trace_folder() == Path("/data/cache/traces")


def test_a_write_that_fails_is_counted_with_its_reason(
    traced: list[object], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    before = trace_cache.writes("trace")
    cached_trace(*_ARGS)
    blocked = tmp_path / "a-file"
    blocked.write_text("not a folder")
    monkeypatch.setenv("MESHPIPE_TRACE_CACHE", str(blocked / "traces"))
    forget_traces()
    cached_trace(*_ARGS)
    assert trace_cache.writes("trace").since(before) == trace_cache.Writes(
        tried=2, failed=1, reason="Not a directory"
    )
