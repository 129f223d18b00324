"""A stage of one backward style derived from the same stage's trace with the other style
after it (`engine.memory.trace_store.first_style`, DualPipeV's stages), instead of traced again:
equal to its own trace, and only the two-style stage traced where a search wants both."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from dataclasses import replace

import pytest

from engine.memory.replay import StageShape
from engine.memory.trace_store import (
    TraceRequest,
    cached_trace,
    first_style,
    forget_traces,
    trace_ahead,
)
from engine.memory.traces import StageTrace, trace_stage
from models import layer_specs
from tests.unit.tiny_stage import TINY_SHAPE

_traces = sys.modules[cached_trace.__module__]
_tracing = sys.modules[trace_stage.__module__]

_SHAPE = TINY_SHAPE

_CASES = {
    "gpt": ("gpt-tiny", _SHAPE),
    "gpt, fp32, recompute": ("gpt-tiny", replace(_SHAPE, precision="fp32", recompute="full")),
    "gpt, fp16": ("gpt-tiny", replace(_SHAPE, precision="fp16")),
    "llama, per-layer recompute": ("llama-tiny", replace(_SHAPE, recompute="every:1")),
    "llama, tp 2, sequence parallel": (
        "llama-tiny",
        replace(_SHAPE, tp=2, sequence_parallel=True),
    ),
    "llama, ZeRO-3": ("llama-tiny", replace(_SHAPE, fsdp_replicas=2)),
    "gpt, ZeRO-3, tp 2": ("gpt-tiny", replace(_SHAPE, fsdp_replicas=2, tp=2)),
}
"""(ZeRO-3 resharded per micro-batch runs no split backward, so no stage of two styles.)"""

_ENDS = {"middle": (slice(1, 3), False, False), "first": (slice(0, 2), True, False)}
_ENDS["last"] = (slice(-3, None), False, True)


def _traced(model: str, shape: StageShape, styles: tuple[bool, ...], end: str) -> StageTrace:
    layers, first, last = _ENDS[end]
    specs = tuple(layer_specs(model)[layers])
    return trace_stage(
        specs, first=first, last=last, styles=styles, shape=shape, cuda=False, block=1
    )


@pytest.mark.parametrize("case", _CASES)
@pytest.mark.parametrize("style", [False, True])
def test_one_style_derived_from_two_equals_its_own_trace(case: str, style: bool) -> None:
    model, shape = _CASES[case]
    mixed = _traced(model, shape, (style, not style), "middle")
    assert first_style(mixed) == _traced(model, shape, (style,), "middle")


@pytest.mark.parametrize("end", ["first", "last"])
@pytest.mark.parametrize("style", [False, True])
def test_the_first_and_last_stages_derive_one_style_too(end: str, style: bool) -> None:
    mixed = _traced("gpt-tiny", _SHAPE, (style, not style), end)
    assert first_style(mixed) == _traced("gpt-tiny", _SHAPE, (style,), end)


@pytest.mark.parametrize("case", _CASES)
@pytest.mark.parametrize("style", [False, True])
def test_the_second_styles_later_micro_batch_allocates_as_its_first(
    case: str, style: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """So it is traced once: tracing a second one of it changes nothing in the trace."""
    model, shape = _CASES[case]
    once = _traced(model, shape, (style, not style), "middle")
    monkeypatch.setattr(_tracing, "SECOND_STYLE_RUNS", 2)
    assert _traced(model, shape, (style, not style), "middle") == once


@pytest.mark.parametrize("end", ["first", "last"])
def test_the_second_style_is_traced_once_on_the_first_and_last_stages_too(
    end: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    once = _traced("llama-tiny", _SHAPE, (True, False), end)
    monkeypatch.setattr(_tracing, "SECOND_STYLE_RUNS", 2)
    assert _traced("llama-tiny", _SHAPE, (True, False), end) == once


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[bool, ...]]]:
    """No trace held or on disk, one worker, and the styles of every real trace."""
    monkeypatch.setenv("MESHPIPE_TRACE_CACHE", "off")
    monkeypatch.setenv("MESHPIPE_TRACE_WORKERS", "1")
    forget_traces()
    made: list[tuple[bool, ...]] = []
    real = _traces.trace_stage

    def recording(*args: object, styles: tuple[bool, ...], **kwargs: object) -> object:
        made.append(styles)
        return real(*args, styles=styles, **kwargs)

    monkeypatch.setattr(_traces, "trace_stage", recording)
    yield made
    forget_traces()


def _request(styles: tuple[bool, ...]) -> TraceRequest:
    return TraceRequest(tuple(layer_specs("gpt-tiny")[1:3]), False, False, styles, _SHAPE, "cpu")


def test_traces_made_ahead_trace_the_two_style_stage_and_derive_the_one_style_one(
    recorded: list[tuple[bool, ...]],
) -> None:
    trace_ahead([_request((True,)), _request((True, False)), _request((False,))])
    assert recorded == [(True, False), (False,)]  # (False,) has no (False, True) to come from
    assert cached_trace(*_request((True,))) == first_style(cached_trace(*_request((True, False))))
    assert recorded == [(True, False), (False,)]


def test_one_style_is_traced_when_no_two_style_trace_is_held(
    recorded: list[tuple[bool, ...]],
) -> None:
    cached_trace(*_request((True,)))
    assert recorded == [(True,)]
