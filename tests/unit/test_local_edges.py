"""A V placement's stage whose neighbour shares its rank (`local_in`, `local_out`), derived
from the same stage's trace with both edges remote (`engine.memory.trace_store.with_local_edges`)
instead of traced again: equal to its own trace, and traced where it could not be equal."""

from __future__ import annotations

import functools
import sys
from collections.abc import Iterator
from dataclasses import replace

import pytest
import torch

from engine.memory.replay import StageRun, StageShape, build_stage, fake_parameters
from engine.memory.trace_store import (
    TraceRequest,
    cached_trace,
    forget_traces,
    trace_ahead,
    with_local_edges,
)
from engine.memory.traces import StageTrace, trace_stage
from models import layer_specs
from tests.unit.tiny_stage import TINY_SHAPE

_traces = sys.modules[cached_trace.__module__]

_SHAPE = TINY_SHAPE

_CASES = {
    "gpt, fused": ("gpt-tiny", (False,), _SHAPE),
    "gpt, split": ("gpt-tiny", (True,), _SHAPE),
    "gpt, fused then split (DualPipeV)": ("gpt-tiny", (False, True), _SHAPE),
    "gpt, split then fused": ("gpt-tiny", (True, False), _SHAPE),
    "gpt, fp32, recompute": (
        "gpt-tiny",
        (True,),
        replace(_SHAPE, precision="fp32", recompute="full"),
    ),
    "gpt, fp16": ("gpt-tiny", (False,), replace(_SHAPE, precision="fp16")),
    "llama, split": ("llama-tiny", (True,), _SHAPE),
    "llama, per-layer recompute": (
        "llama-tiny",
        (False, True),
        replace(_SHAPE, recompute="every:1"),
    ),
    "llama, tp 2": ("llama-tiny", (True,), replace(_SHAPE, tp=2)),
    "llama, tp 2, sequence parallel": (
        "llama-tiny",
        (False, True),
        replace(_SHAPE, tp=2, sequence_parallel=True),
    ),
    "llama, ZeRO-3": ("llama-tiny", (True,), replace(_SHAPE, fsdp_replicas=2)),
    "gpt, ZeRO-3 per micro-batch, tp 2": (
        "gpt-tiny",
        (False,),
        replace(_SHAPE, fsdp_replicas=2, fsdp_reshard="micro-batch", tp=2),
    ),
}


@functools.cache
def _traced(
    model: str, styles: tuple[bool, ...], shape: StageShape, local: tuple[bool, bool]
) -> StageTrace:
    """Two middle blocks of the model as one stage."""
    specs = tuple(layer_specs(model)[1:3])
    return trace_stage(
        specs, first=False, last=False, styles=styles, shape=shape, cuda=False, block=1, local=local
    )


@pytest.mark.parametrize("case", _CASES)
@pytest.mark.parametrize("local", [(True, False), (False, True)])
def test_a_local_edge_derived_from_the_remote_trace_equals_its_own_trace(
    case: str, local: tuple[bool, bool]
) -> None:
    model, styles, shape = _CASES[case]
    remote = _traced(model, styles, shape, (False, False))
    assert not remote.sends_copied
    assert with_local_edges(remote, local) == _traced(model, styles, shape, local)


@pytest.mark.parametrize("model", ["gpt-tiny", "llama-tiny"])
@pytest.mark.parametrize("styles", [(False,), (True,), (False, True)])
@pytest.mark.parametrize("end", ["first", "last"])
def test_the_first_and_last_stages_of_one_rank_derive_their_shared_edge(
    model: str, styles: tuple[bool, ...], end: str
) -> None:
    """A V placement on one rank: the first stage's output and the last stage's input are
    handed over in memory."""
    specs, first = layer_specs(model), end == "first"
    layers = tuple(specs[:2] if first else specs[-3:])
    local = (False, True) if first else (True, False)

    def traced(edges: tuple[bool, bool]) -> StageTrace:
        return trace_stage(
            layers, first=first, last=not first, styles=styles, shape=_SHAPE, cuda=False,
            block=1, local=edges,
        )  # fmt: skip

    remote = traced((False, False))
    assert not remote.sends_copied
    assert with_local_edges(remote, local) == traced(local)


def test_a_local_input_edge_holds_and_sends_back_nothing() -> None:
    model, styles, shape = _CASES["gpt, split"]
    remote = _traced(model, styles, shape, (False, False))
    local = with_local_edges(remote, (True, False))
    assert remote.sent_back > 0
    assert (local.sent_back, local.held_per_micro_batch) == (0, 0)


def test_a_send_of_a_tensor_that_is_not_contiguous_is_a_copy_and_says_so() -> None:
    specs = tuple(layer_specs("gpt-tiny")[1:2])
    module = build_stage(specs)
    fake_parameters(module)
    run = StageRun(module, specs, first=False, last=False, split=frozenset(), shape=_SHAPE)
    run.sent[0] = run._payload((torch.zeros(4, 2),))
    assert not run.sends_copied
    run.sent[1] = run._payload((torch.zeros(4, 2).t(),))
    assert run.sends_copied


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[bool, bool]]]:
    """No trace held or on disk, one worker, and the local edges of every real trace."""
    monkeypatch.setenv("MESHPIPE_TRACE_CACHE", "off")
    monkeypatch.setenv("MESHPIPE_TRACE_WORKERS", "1")
    forget_traces()
    made: list[tuple[bool, bool]] = []
    real = _traces.trace_stage

    def recording(*args: object, local: tuple[bool, bool], **kwargs: object) -> object:
        made.append(local)
        return real(*args, local=local, **kwargs)

    monkeypatch.setattr(_traces, "trace_stage", recording)
    yield made
    forget_traces()


def _request(local: tuple[bool, bool]) -> TraceRequest:
    return TraceRequest(
        tuple(layer_specs("gpt-tiny")[1:3]), False, False, (True,), _SHAPE, "cpu", local
    )


def test_traces_made_ahead_trace_only_the_remote_stage_of_a_local_edge(
    recorded: list[tuple[bool, bool]],
) -> None:
    trace_ahead([_request((False, True)), _request((True, False))])
    assert recorded == [(False, False)]
    assert cached_trace(*_request((True, False))).sent_back == 0
    assert recorded == [(False, False)]


def test_a_local_edge_whose_remote_send_was_a_copy_is_traced_itself(
    recorded: list[tuple[bool, bool]], monkeypatch: pytest.MonkeyPatch
) -> None:
    remote = cached_trace(*_request((False, False)))
    _traces._keep(_request((False, False)), replace(remote, sends_copied=True))
    cached_trace(*_request((True, False)))
    assert recorded == [(False, False), (True, False)]
