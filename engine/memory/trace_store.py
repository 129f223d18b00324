"""The stage traces a process holds: each distinct stage traced once (`trace_stage`), kept
on disk between runs (`engine.memory.trace_cache`), derived from another trace where that is
exact (a local edge, one backward style of two), and traced ahead in worker processes where a
caller knows every trace it will ask for (`trace_ahead`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from concurrent.futures.process import BrokenProcessPool
from dataclasses import replace
from typing import NamedTuple

from engine.memory.replay import StageShape
from engine.memory.trace_cache import load_trace, store_trace, trace_key
from engine.memory.traces import Phase, StageTrace, trace_stage
from engine.memory.tracker import CUDA_BLOCK, Span
from engine.memory.workers import in_workers
from engine.schedule.actions import ActionKind
from models import LayerSpec

__all__ = [
    "TraceRequest",
    "cached_trace",
    "first_style",
    "forget_traces",
    "hold_traces",
    "trace_ahead",
    "with_local_edges",
]


class TraceRequest(NamedTuple):
    """One distinct stage to trace: `cached_trace`'s arguments."""

    specs: tuple[LayerSpec, ...]
    first: bool
    last: bool
    styles: tuple[bool, ...]
    shape: StageShape
    device: str
    local: tuple[bool, bool] = (False, False)

    @property
    def remote(self) -> TraceRequest:
        """The stage with both edges crossing ranks (what `with_local_edges` derives from)."""
        return self._replace(local=(False, False))

    @property
    def mixed(self) -> TraceRequest | None:
        """Of a stage of one backward style, the same stage with the other style after it
        (what `first_style` derives from); None for a stage of no style or of two."""
        if len(self.styles) != 1:
            return None
        return self._replace(styles=(self.styles[0], not self.styles[0]))


_TRACED: dict[TraceRequest, StageTrace] = {}
"""Every trace this process made, read, derived or was handed (`trace_ahead`, `hold_traces`)."""


def cached_trace(
    specs: tuple[LayerSpec, ...],
    first: bool,
    last: bool,
    styles: tuple[bool, ...],
    shape: StageShape,
    device: str,
    local: tuple[bool, bool] = (False, False),
) -> StageTrace:
    """`trace_stage`, once per distinct stage (stages built alike allocate alike), and kept on
    disk between runs (`engine.memory.trace_cache`)."""
    request = TraceRequest(specs, first, last, styles, shape, device, local)
    known = _held(request)
    if known is None:
        known = _derived(request) or _traced(request)
        _keep(request, known)
    return known


def _derived(request: TraceRequest) -> StageTrace | None:
    """A V placement's stage whose neighbour shares its rank, from the same stage's trace
    with both edges remote (traced or held), where that can be exact; a stage of one
    backward style from the same stage's trace with the other style after it, where that
    is held; else None."""
    if request.local != (False, False):
        remote = cached_trace(*request.remote)
        return None if remote.sends_copied else with_local_edges(remote, request.local)
    mixed = None if request.mixed is None else _held(request.mixed)
    return None if mixed is None else first_style(mixed)


def first_style(mixed: StageTrace) -> StageTrace:
    """A stage of two backward styles (DualPipeV's: each style's first and later
    micro-batch, in the stage's order) as the same stage of its first style alone. Until the
    second style starts, the two ran the same actions on the same state, and what a trace
    keeps of a step beyond its spans (held, sent back, weight copies) comes from the first
    micro-batch; tested equal to its own trace, ZeRO-3's reduction and recompute too
    (tests/unit/test_first_style.py)."""
    style = next(style for _, style in mixed.first)

    def kept(spans: Mapping[Phase, Span]) -> dict[Phase, Span]:
        return {phase: span for phase, span in spans.items() if phase[1] == style}

    return replace(mixed, first=kept(mixed.first), later=kept(mixed.later))


def with_local_edges(remote: StageTrace, local: tuple[bool, bool]) -> StageTrace:
    """`remote` (both edges cross ranks) as the same stage's with its previous (`local[0]`)
    or next (`local[1]`) stage on its rank, the hand-off not held as a send. Local out changes
    nothing: the stage holds its output until its backward either way, the send that very
    tensor. Local in hands the input gradients over as each backward (B or I) ends: lower by
    them, nothing held or sent back. Exact where no send was a copy (`sends_copied`)."""
    if not local[0]:
        return remote
    sent = remote.sent_back

    def handed_over(spans: Mapping[Phase, Span]) -> dict[Phase, Span]:
        backward = (ActionKind.B, ActionKind.I)
        return {
            phase: Span(peak=span.peak, net=span.net - sent) if phase[0] in backward else span
            for phase, span in spans.items()
        }

    return replace(
        remote,
        first=handed_over(remote.first),
        later=handed_over(remote.later),
        held_per_micro_batch=remote.held_per_micro_batch - sent,
        sent_back=0,
    )


def _held(request: TraceRequest) -> StageTrace | None:
    """The request's trace if held here or on disk (then held from now on), else None."""
    known = _TRACED.get(request)
    if known is None:
        known = load_trace(trace_key(*request), StageTrace)
        if known is not None:
            _TRACED[request] = known
    return known


def _keep(request: TraceRequest, trace: StageTrace) -> None:
    """A trace just made: held by this process and written to the disk cache."""
    _TRACED[request] = trace
    store_trace(trace_key(*request), trace)


def hold_traces(traces: Mapping[TraceRequest, StageTrace]) -> None:
    """Traces made elsewhere (another process), held here as if made here."""
    _TRACED.update(traces)


def forget_traces() -> None:
    """Forget the traces this process holds (the disk's stay), as a new process would."""
    _TRACED.clear()


def _traced(request: TraceRequest) -> StageTrace:
    cuda = request.device == "cuda"
    return trace_stage(
        request.specs,
        first=request.first,
        last=request.last,
        styles=request.styles,
        shape=request.shape,
        cuda=cuda,
        block=CUDA_BLOCK if cuda else 1,
        local=request.local,
    )


def trace_ahead(
    requests: Iterable[TraceRequest], progress: Callable[[int, int], None] | None = None
) -> None:
    """Trace the requests this process does not hold yet (a local edge's remote stage, to
    derive it from), so that `cached_trace` finds them made: in worker processes where the
    machine has the cores, longest first; else here, in turn. `progress(done, total)` once
    before the first (done 0: a first trace in a process takes a second or more) and after
    each.

    A search knows every trace it will ask for before it asks, each is independent of the
    others, and a first search spends most of its time in them (`engine.memory.workers`).
    """
    wanted = dict.fromkeys(r for r in dict.fromkeys(requests) if _held(r) is None)
    remote = dict.fromkeys(r.remote for r in wanted)
    missing = [r for r in remote if r in wanted or _held(r) is None]  # `wanted`: not held
    traced = set(missing)
    missing = [r for r in missing if r.mixed not in traced]  # derived from it (`first_style`)
    missing.sort(key=lambda r: len(r.specs), reverse=True)
    if progress is not None and missing:
        progress(0, len(missing))
    made = in_workers(_traced, missing)
    try:
        for done, (request, trace) in enumerate(zip(missing, made, strict=True), start=1):
            _keep(request, trace)
            if progress is not None:
                progress(done, len(missing))
    except BrokenProcessPool:
        return  # a worker died (out of memory?): `cached_trace` traces the rest here, when asked
    for request in wanted:
        cached_trace(*request)  # derived here, or traced where a send was a copy
