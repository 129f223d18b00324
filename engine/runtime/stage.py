"""A pipeline stage: its own layers and the per-micro-batch state its backward needs.

The stage computes; it never communicates. Inputs arrive as tensors (received activations or
the first stage's token ids), outputs leave as tensors; between a micro-batch's forward and
backward the stage stashes its inputs and outputs — the micro-batch is *in flight*.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.checkpoint import checkpoint

from engine.config import recompute_groups
from engine.parallel import local_tensor, sharded_loss_scope, stage_layers
from engine.runtime.linear_records import LinearRecorder
from engine.runtime.micro_batches import LossFn
from engine.runtime.precision import autocast, compute_dtype, step_casts
from engine.runtime.stage_errors import StageError, input_message
from engine.runtime.weight_copies import WeightCopies
from engine.runtime.weight_grads import (
    PendingWeightGrad,
    Recorded,
    run_weight_grads,
    split_input_grads,
)
from models import LayerSpec, LayerStack, document_scope, lm_loss

__all__ = ["PipelineStage", "StageError"]


@dataclass
class _InFlight:
    inputs: tuple[torch.Tensor, ...]
    outputs: tuple[torch.Tensor, ...]
    weight_nodes: list[Recorded]
    """(Linear, its input, its output's gradient edge) of every Linear, in forward order
    (`LinearRecorder`)."""
    documents: torch.Tensor | None = None
    """The micro-batch's document ids (packed documents): a recomputing backward needs them."""


class PipelineStage:
    """The layers `[first, last)` of a layer list, built and initialised on this rank only."""

    def __init__(
        self,
        specs: Sequence[LayerSpec],
        *,
        stage: int,
        layers: range,
        num_stages: int,
        seed: int,
        device: torch.device | str = "cpu",
        loss_fn: LossFn = lm_loss,
        precision: str = "fp32",
        recompute: str = "none",
        compile: bool = False,
        built: LayerStack | None = None,
        tp_mesh: DeviceMesh | None = None,
        sequence_parallel: bool = False,
    ) -> None:
        """`built`: the stage's layers already made (the memory replay's fake ones); by
        default they are built and initialised here, on `device`. `tp_mesh`: split every layer
        over these tensor-parallel ranks (each keeps its slice of the full initial weights);
        `sequence_parallel`: and keep the activations between them as sequence shards (the
        stage's input and output are this rank's 1/tp of the sequence)."""
        self.stage, self.num_stages, self.layers = stage, num_stages, layers
        self.specs = [specs[i] for i in layers]
        self.sequence_parallel = sequence_parallel
        self._tp = tp_mesh.size() if tp_mesh is not None else 1
        self.module = stage_layers(
            specs,
            layers,
            seed=seed,
            device=device,
            built=built,
            tp_mesh=tp_mesh,
            sequence_parallel=sequence_parallel,
        )
        self.loss_fn = loss_fn
        self.precision, self.device = precision, torch.device(device)
        modules = list(self.module.layers.values())
        self.tensor_parallel = tp_mesh is not None
        self.compiled = compile
        if compile:
            for module in modules:
                module.compile()  # in place: parameter names and state dicts stay as they are
        self._runs = [
            (nn.Sequential(*(modules[i] for i in run)), again)
            for run, again in recompute_groups(len(modules), recompute)
        ]
        self._in_flight: dict[int, _InFlight] = {}
        self._pending_w: dict[int, PendingWeightGrad] = {}
        self._linears = LinearRecorder()
        self._hooks_on = False
        self._fused_weight_grads = False
        self._eager_modules: list[nn.Module] = []
        dtype = compute_dtype(precision)
        self._copies = WeightCopies(self.module, dtype) if dtype is not torch.float32 else None
        self._fold_gradients: Callable[[], None] = lambda: None
        self._in_step = False
        self.peak_in_flight = 0
        self.peak_pending_w = 0

    def fully_shard(self, fold_gradients: Callable[[], None]) -> None:
        """ZeRO-3: no per-step low-precision copies (FSDP gathers every weight in the compute
        dtype itself), and each I and W ends with `fold_gradients`, which hands the gradients
        they assigned outside autograd (W's, and I's of the non-Linear parameters) to FSDP's
        fp32 accumulation, as FSDP's post-backward does for autograd's. Otherwise two of a
        row would sum in the compute dtype, and what a stage holds would depend on the order."""
        self._copies = None
        self._fold_gradients = fold_gradients

    def enable_split_backward(self) -> None:
        """Prepare the split backward: I now, the weight GEMMs later in W.

        Only a GEMM's weight gradient (gᵀ·x of every `nn.Linear`) is worth deferring; forward
        hooks record each Linear's input and output's gradient edge (`LinearRecorder`). The
        I pass asks autograd for the stage input's gradient, each Linear output's gradient
        and, at once, the gradients of every other parameter (norms, embeddings: cheap
        reductions that would otherwise need a second pass over their inputs in W). Every
        kernel runs once, as in a fused backward.
        """
        if self._hooks_on or self._fused_weight_grads:
            return
        if self.compiled:
            raise ValueError(
                f"stage {self.stage} is compiled, and a compiled layer hides the Linears whose "
                "weight gradients a split backward (I now, W later) defers: use a schedule "
                "without I/W actions (1f1b, gpipe, interleaved_1f1b, looped_bfs) with compile, "
                "or run the zero-bubble schedule uncompiled"
            )
        owners = [m for m in self.module.modules() if list(m.parameters(recurse=False))]
        uses = [id(p) for m in owners for p in m.parameters(recurse=False)]
        recomputed = any(again for _, again in self._runs)
        if len(uses) != len(set(uses)) or recomputed:
            # A parameter used by two modules of this stage (a tie held in one stage): the
            # gradient at one module's output reaches it through the other too, so W cannot
            # be taken per module. With recomputation, every per-module W would re-run the
            # checkpointed forward. Such a stage runs its whole backward at I; W is empty.
            self._fused_weight_grads = True
            return
        for module in owners:
            if isinstance(module, nn.Linear):
                self._linears.install(module)
            else:
                self._eager_modules.append(module)
        self._hooks_on = True

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    @contextlib.contextmanager
    def step_scope(self) -> Iterator[None]:
        """One training step: its first forward makes the step's low-precision copies of the
        Linear weights (`WeightCopies`), which every micro-batch and recompute shares, and
        autocast's cast cache stays open for any other weight cast (`step_casts`). On exit,
        before the optimizer, the fp32 masters are back in the modules, holding the step's
        gradients. Outside a step scope forwards cast per micro-batch, as autocast does."""
        self._in_step = True
        try:
            with step_casts(self.precision, self.device):
                yield
        except BaseException:
            self._in_flight.clear()  # a failed step's micro-batches never get their backward
            self._pending_w.clear()
            raise
        finally:
            self._in_step = False
            if self._copies is not None:
                self._copies.restore()

    def reset_peak(self) -> None:
        self.peak_in_flight = len(self._in_flight)
        self.peak_pending_w = len(self._pending_w)

    def forward(
        self,
        micro_batch: int,
        inputs: tuple[torch.Tensor, ...],
        *,
        targets: torch.Tensor | None = None,
        loss_divisor: int = 1,
        loss_scale: float = 1.0,
        training: bool = True,
        split: bool = True,
        documents: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, ...]:
        """Run the stage on one micro-batch; the last stage returns its (unscaled) loss.

        In training the last stage keeps `loss / loss_divisor` for the backward (the number of
        micro-batches, exactly as the reference divides), other stages keep their outputs.
        `split=False` says this micro-batch's backward will be a fused B, so the Linears'
        inputs and outputs need not be recorded for a W. `documents`: the micro-batch's
        document ids when documents are packed (`models.documents`).
        """
        self._check_sequence(micro_batch, inputs[0])
        capture: list[Recorded] = []
        recording = capture if training and split and self._hooks_on else None
        if training and self._in_step and self._copies is not None:
            self._copies.install()
        with (
            torch.set_grad_enabled(training),
            autocast(self.precision, self.device),
            document_scope(documents),
        ):
            with self._linears.recording(recording):
                out = self._run_checked(micro_batch, inputs, training)
            outputs, result = self._outputs(out, targets, loss_divisor, loss_scale, training)
        if training:
            self._in_flight[micro_batch] = _InFlight(inputs, outputs, capture, documents)
            self.peak_in_flight = max(self.peak_in_flight, len(self._in_flight))
        return result

    def _run_checked(
        self, micro_batch: int, inputs: tuple[torch.Tensor, ...], training: bool
    ) -> torch.Tensor:
        """The stage's layers on the micro-batch; a failure says what the input was."""
        try:
            return self._run_layers(inputs[0], training)
        except (RuntimeError, ValueError, IndexError) as error:
            message = input_message(
                stage=self.stage,
                layers=self.layers,
                first_kind=self.specs[0].kind,
                module=self.module,
                micro_batch=micro_batch,
                inputs=inputs,
                error=error,
            )
            raise StageError(message) from error

    def _outputs(
        self,
        out: torch.Tensor,
        targets: torch.Tensor | None,
        loss_divisor: int,
        loss_scale: float,
        training: bool,
    ) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        """(what the backward starts from, what the caller gets): the last stage's scaled loss
        and its loss, the others' output in the compute dtype, twice."""
        if not self.is_last:
            dtype = compute_dtype(self.precision)
            out = out.to(dtype) if out.is_floating_point() else out
            return (out,), (out,)
        if targets is None:
            raise StageError(f"stage {self.stage} is last but got no targets")
        with sharded_loss_scope(self.tensor_parallel):
            loss = self.loss_fn(out, targets)
        root = loss / loss_divisor if loss_scale == 1.0 else loss / loss_divisor * loss_scale
        return ((root,) if training else ()), (local_tensor(loss.detach()),)

    def _check_sequence(self, micro_batch: int, tokens: torch.Tensor) -> None:
        """Sequence parallelism cuts the first stage's sequence into tp equal shards."""
        if not (self.sequence_parallel and self.is_first) or tokens.shape[1] % self._tp == 0:
            return
        raise StageError(
            f"stage {self.stage} got micro-batch {micro_batch} with a sequence of "
            f"{tokens.shape[1]} tokens, which does not split into tp={self._tp} equal sequence "
            f"shards (sequence parallelism): use a sequence length that is a multiple of "
            f"{self._tp}, or turn sequence parallelism off"
        )

    def _run_layers(self, x: torch.Tensor, training: bool) -> torch.Tensor:
        """The stage's layers in order; recomputed runs keep only their input for backward
        (the received one: the first run widens it inside)."""
        for k, (run, again) in enumerate(self._runs):
            step = partial(self._widened_run, run) if k == 0 else run
            x = checkpoint(step, x, use_reentrant=False) if again and training else step(x)
        return x

    def _widened_run(self, run: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """Run on the received activation back in fp32: only the exchange is narrowed to the
        compute dtype. The residual stream stays fp32 under autocast, as in the single-process
        run, and norms see input and weight of one dtype (the fused kernel, not the composite).
        """
        if self.precision != "fp32" and x.is_floating_point() and x.dtype != torch.float32:
            x = x.float()
        return run(x)  # type: ignore[no-any-return]

    def _pop(self, micro_batch: int) -> _InFlight:
        state = self._in_flight.pop(micro_batch, None)
        if state is None:
            raise StageError(
                f"stage {self.stage} has no forward state for micro-batch {micro_batch}: "
                "the schedule runs its backward before its forward or twice"
            )
        return state

    def _roots(
        self, state: _InFlight, output_grads: tuple[torch.Tensor, ...]
    ) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        if self.is_last:
            return list(state.outputs), None
        pairs = [
            (o, g) for o, g in zip(state.outputs, output_grads, strict=True) if o.requires_grad
        ]
        return [o for o, _ in pairs], [g for _, g in pairs]

    def backward(
        self, micro_batch: int, output_grads: tuple[torch.Tensor, ...] = ()
    ) -> tuple[torch.Tensor, ...]:
        """Backward of one micro-batch: accumulate parameter grads, return input grads."""
        state = self._pop(micro_batch)
        roots, grads = self._roots(state, output_grads)
        with (
            sharded_loss_scope(self.tensor_parallel and self.is_last),
            document_scope(state.documents),
        ):
            torch.autograd.backward(roots, grad_tensors=grads)
        return tuple(x.grad for x in state.inputs if x.requires_grad and x.grad is not None)

    def backward_input(
        self, micro_batch: int, output_grads: tuple[torch.Tensor, ...] = ()
    ) -> tuple[torch.Tensor, ...]:
        """The I half: gradients of the stage input (to send upstream at once), of every
        Linear's output (kept for W) and of every other parameter (accumulated now).

        W computes each Linear's weight gradient itself from (input, output gradient), so the
        graph is freed here. A stage whose W cannot be taken per module (a tie inside it, or
        recompute) runs its whole backward here and leaves W nothing.
        """
        if self._fused_weight_grads:
            input_grads = self.backward(micro_batch, output_grads)
            self._pending_w[micro_batch] = PendingWeightGrad([])
            self.peak_pending_w = max(self.peak_pending_w, len(self._pending_w))
            return input_grads
        state = self._pop(micro_batch)
        roots, grads = self._roots(state, output_grads)
        eager = [  # looked up now: FSDP (ZeRO-3) swaps a layer's parameters as it gathers
            p for m in self._eager_modules for p in m.parameters(recurse=False) if p.requires_grad
        ]
        with (
            sharded_loss_scope(self.tensor_parallel and self.is_last),
            document_scope(state.documents),
        ):
            input_grads, pending = split_input_grads(
                roots,
                grads,
                state.inputs,
                state.weight_nodes,
                eager,
            )
        self._fold_gradients()
        self._pending_w[micro_batch] = pending
        self.peak_pending_w = max(self.peak_pending_w, len(self._pending_w))
        return input_grads

    def backward_weight(self, micro_batch: int) -> None:
        """The W half: each Linear's parameter gradients from its output's gradient
        (`run_weight_grads`)."""
        pending = self._pending_w.pop(micro_batch, None)
        if pending is None:
            raise StageError(
                f"stage {self.stage} has no input-gradient state for micro-batch {micro_batch}: "
                "the schedule runs its W before its I or twice"
            )
        run_weight_grads(pending, None if self._copies is None else self._copies.master)
        self._fold_gradients()
