"""A pipeline stage: its own layers and the per-micro-batch state its backward needs.

The stage computes; it never communicates. Inputs arrive as tensors (received activations or
the first stage's token ids), outputs leave as tensors; between a micro-batch's forward and
backward the stage stashes its inputs and outputs — the micro-batch is *in flight*.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.reference import LossFn
from models import LayerSpec, build_layers, lm_loss

__all__ = ["PipelineStage", "StageError"]


class StageError(RuntimeError):
    """A stage could not compute a micro-batch (for example a shape mismatch at its input)."""


@dataclass
class _InFlight:
    inputs: tuple[torch.Tensor, ...]
    outputs: tuple[torch.Tensor, ...]


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
    ) -> None:
        self.stage, self.num_stages, self.layers = stage, num_stages, layers
        self.specs = [specs[i] for i in layers]
        self.module = build_layers(specs, layers, seed=seed, device=device)
        self.loss_fn = loss_fn
        self._in_flight: dict[int, _InFlight] = {}
        self.peak_in_flight = 0

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    def reset_peak(self) -> None:
        self.peak_in_flight = len(self._in_flight)

    def forward(
        self,
        micro_batch: int,
        inputs: tuple[torch.Tensor, ...],
        *,
        targets: torch.Tensor | None = None,
        loss_divisor: int = 1,
        training: bool = True,
    ) -> tuple[torch.Tensor, ...]:
        """Run the stage on one micro-batch; the last stage returns its (unscaled) loss.

        In training the last stage keeps `loss / loss_divisor` for the backward (the number of
        micro-batches, exactly as the reference divides), other stages keep their outputs.
        """
        with torch.set_grad_enabled(training):
            try:
                out = self.module(*inputs)
            except (RuntimeError, ValueError) as error:
                raise StageError(self._shape_message(micro_batch, inputs, error)) from error
            if self.is_last:
                if targets is None:
                    raise StageError(f"stage {self.stage} is last but got no targets")
                loss = self.loss_fn(out, targets)
                outputs: tuple[torch.Tensor, ...] = (loss / loss_divisor,) if training else ()
                result: tuple[torch.Tensor, ...] = (loss.detach(),)
            else:
                outputs = result = out if isinstance(out, tuple) else (out,)
        if training:
            self._in_flight[micro_batch] = _InFlight(inputs, outputs)
            self.peak_in_flight = max(self.peak_in_flight, len(self._in_flight))
        return result

    def backward(
        self, micro_batch: int, output_grads: tuple[torch.Tensor, ...] = ()
    ) -> tuple[torch.Tensor, ...]:
        """Backward of one micro-batch: accumulate parameter grads, return input grads."""
        state = self._in_flight.pop(micro_batch, None)
        if state is None:
            raise StageError(
                f"stage {self.stage} has no forward state for micro-batch {micro_batch}: "
                "the schedule runs its backward before its forward or twice"
            )
        if self.is_last:
            torch.autograd.backward(state.outputs)
        else:
            pairs = [
                (o, g) for o, g in zip(state.outputs, output_grads, strict=True) if o.requires_grad
            ]
            torch.autograd.backward([o for o, _ in pairs], grad_tensors=[g for _, g in pairs])
        return tuple(x.grad for x in state.inputs if x.requires_grad and x.grad is not None)

    def _shape_message(
        self, micro_batch: int, inputs: tuple[torch.Tensor, ...], error: Exception
    ) -> str:
        first = self.layers.start
        shapes = [tuple(t.shape) for t in inputs]
        return (
            f"stage {self.stage} (layers [{first}, {self.layers.stop}), first layer "
            f"{self.specs[0].kind}) failed on micro-batch {micro_batch} with inputs of shapes "
            f"{shapes}: {error}. If the shapes disagree with what layer {first} expects, the "
            "layer list's stages disagree on the activation shape at this boundary"
        )
