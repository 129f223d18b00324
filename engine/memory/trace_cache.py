"""Stage traces kept on disk, so a plan or an estimate traces nothing a run before it traced;
and beside them what else the planner derives at length from the code alone (a schedule's
in-flight counts, `engine.plan.context`).

A trace (`StageTrace`) follows from the stage's layers, its shape, the device and the code that
runs it (meshpipe's packages and torch). A file's name is the digest of all of them: changed
code or another torch reads other names, never a stale trace. Each file carries its payload's
sha256, checked on every read; a file that fails is traced again and written anew, atomically.

`MESHPIPE_TRACE_CACHE` names the folder, or `off` for none; by default it is `traces/` in
`MESHPIPE_CACHE` (or ~/.cache/meshpipe), the prepared corpus's folder.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

import torch

from engine.memory.tracker import Span
from engine.schedule.actions import ActionKind

__all__ = [
    "TRACE_CACHE_VERSION",
    "Writes",
    "load_payload",
    "load_trace",
    "store_payload",
    "store_trace",
    "trace_folder",
    "trace_key",
    "writes",
]

TRACE_CACHE_VERSION = 1
"""The file format; part of every name."""

_T = TypeVar("_T")
_PACKAGES = ("engine", "models", "partitioners")
_ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Writes:
    """The payloads of one kind this process tried to keep on disk, and how many it could not:
    a cache that cannot be written costs only speed, but a report that says what was kept
    must know (a full disk passes every permission check)."""

    tried: int = 0
    failed: int = 0
    reason: str = ""
    """Why the last one that failed did."""

    def since(self, earlier: Writes) -> Writes:
        """What was tried after `earlier` (an earlier `writes` of the same kind)."""
        failed = self.failed - earlier.failed
        return Writes(self.tried - earlier.tried, failed, self.reason if failed else "")


_WRITES: dict[str, Writes] = {}


def writes(kind: str) -> Writes:
    """The payloads of `kind` ("trace", "counts") this process has tried to keep so far."""
    return _WRITES.get(kind, Writes())


def trace_folder() -> Path | None:
    """Where traces are kept, or None when `MESHPIPE_TRACE_CACHE=off`."""
    chosen = os.environ.get("MESHPIPE_TRACE_CACHE")
    if chosen == "off":
        return None
    if chosen:
        return Path(chosen)
    root = os.environ.get("MESHPIPE_CACHE")
    return (Path(root) if root else Path.home() / ".cache" / "meshpipe") / "traces"


@functools.cache
def _code_digest() -> str:
    """The sha256 of every source file of meshpipe's packages and of torch's version: what a
    trace depends on besides its arguments."""
    digest = hashlib.sha256(f"torch {torch.__version__}\n".encode())
    for package in _PACKAGES:
        for path in sorted((_ROOT / package).rglob("*.py")):
            digest.update(str(path.relative_to(_ROOT)).encode() + b"\0")
            digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()


def trace_key(*parts: object) -> str:
    """The file name of what follows from `parts` (a trace's request: frozen dataclasses and
    tuples, whose reprs spell out every field) and the code."""
    text = repr((TRACE_CACHE_VERSION, _code_digest(), parts))
    return hashlib.sha256(text.encode()).hexdigest()


def _payload(trace: Any) -> dict[str, Any]:
    def phases(spans: Any) -> list[list[Any]]:
        return [[kind.value, split, s.peak, s.net] for (kind, split), s in spans.items()]

    return {
        "begin": [trace.begin.peak, trace.begin.net],
        "first": phases(trace.first),
        "later": phases(trace.later),
        "held_per_micro_batch": trace.held_per_micro_batch,
        "sent_back": trace.sent_back,
        "weight_copies": trace.weight_copies,
        "reduce": [trace.reduce.peak, trace.reduce.net],
        "sends_copied": trace.sends_copied,
    }


def _digest(payload: Any) -> str:
    return _sha256(json.dumps(payload, sort_keys=True))


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def store_trace(key: str, trace: Any) -> None:
    """Write the trace under `key` (`store_payload`)."""
    store_payload(key, "trace", _payload(trace))


def load_trace(key: str, build: Callable[..., _T]) -> _T | None:
    """The trace stored under `key`, rebuilt with `build` (`StageTrace`), or None when there
    is none or it fails its checksum."""
    payload = load_payload(key, "trace")
    if payload is None:
        return None
    try:
        return build(
            begin=Span(peak=payload["begin"][0], net=payload["begin"][1]),
            first=_spans(payload["first"]),
            later=_spans(payload["later"]),
            held_per_micro_batch=payload["held_per_micro_batch"],
            sent_back=payload["sent_back"],
            weight_copies=payload["weight_copies"],
            reduce=Span(peak=payload["reduce"][0], net=payload["reduce"][1]),
            sends_copied=bool(payload["sends_copied"]),
        )
    except (ValueError, KeyError, TypeError, IndexError):
        return None


def store_payload(key: str, kind: str, payload: Any) -> None:
    """Write `payload` (JSON) under `key` as a `kind`, all or nothing (a temporary file
    renamed over it; not fsynced: a file a crash truncates fails its checksum and is computed
    again). A folder that cannot be written costs only speed: the payload is not kept."""
    folder = trace_folder()
    if folder is None:
        return
    body = json.dumps(payload, sort_keys=True)  # what `_digest` reads back: encoded once
    text = f'{{"sha256": "{_sha256(body)}", {json.dumps(kind)}: {body}}}'
    temporary: str | None = None
    tally = writes(kind)
    tally = replace(tally, tried=tally.tried + 1)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=folder, suffix=".tmp", delete=False) as f:
            temporary = f.name
            f.write(text)
        os.replace(temporary, folder / f"{key}.json")
    except OSError as error:
        tally = replace(tally, failed=tally.failed + 1, reason=error.strerror or str(error))
        if temporary is not None:
            Path(temporary).unlink(missing_ok=True)
    _WRITES[kind] = tally


def load_payload(key: str, kind: str) -> Any:
    """The `kind` stored under `key`, or None when there is none, it is another kind, or it
    fails its checksum."""
    folder = trace_folder()
    if folder is None:
        return None
    try:
        stored = json.loads((folder / f"{key}.json").read_text())
        payload = stored[kind]
        return payload if stored["sha256"] == _digest(payload) else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _spans(rows: Sequence[Sequence[Any]]) -> dict[tuple[ActionKind, bool], Span]:
    return {(ActionKind(kind), bool(split)): Span(peak=p, net=n) for kind, split, p, n in rows}
