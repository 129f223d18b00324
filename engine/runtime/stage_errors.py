"""A stage's failure on a micro-batch, said with its likely cause."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["StageError", "input_message"]


class StageError(RuntimeError):
    """A stage could not compute a micro-batch (for example a shape mismatch at its input)."""


def input_message(
    *,
    stage: int,
    layers: range,
    first_kind: str,
    module: nn.Module,
    micro_batch: int,
    inputs: tuple[torch.Tensor, ...],
    error: Exception,
) -> str:
    """What failed, on what input, and the likely cause: the batch on the first stage, the
    layer list's boundary shapes on the others."""
    first = layers.start
    shapes = [tuple(t.shape) for t in inputs]
    dtypes = [str(t.dtype).removeprefix("torch.") for t in inputs]
    failed = (
        f"stage {stage} (layers [{first}, {layers.stop}), first layer "
        f"{first_kind}) failed on micro-batch {micro_batch} with inputs of shapes "
        f"{shapes} and dtypes {dtypes}: {error}."
    )
    if stage != 0:
        return (
            f"{failed} If the shapes disagree with what layer {first} expects, the layer "
            "list's stages disagree on the activation shape at this boundary"
        )
    tokens = inputs[0]
    vocab = [m.num_embeddings for m in module.modules() if isinstance(m, nn.Embedding)]
    if vocab and not tokens.is_floating_point() and tokens.numel():
        low, high = int(tokens.min()), int(tokens.max())
        if low < 0 or high >= vocab[0]:
            return (
                f"{failed} The batch holds token ids in [{low}, {high}] but the model's "
                f"vocabulary has {vocab[0]}: ids must lie in [0, {vocab[0] - 1}] (tokenize "
                "with the model's tokenizer, or pick a model with a larger vocabulary)"
            )
    return (
        f"{failed} This stage's input is the batch itself: check its dtype (integer token "
        "ids for an embedding), its shape (batch, sequence) and its sequence length"
    )
