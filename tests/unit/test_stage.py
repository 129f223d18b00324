"""A pipeline stage under mixed precision computes as the single-process run does."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from torch import nn

from engine.memory.tracker import MemoryTracker
from engine.runtime.precision import autocast
from engine.runtime.stage import PipelineStage
from models import build_layers, layer_specs, lm_loss

torch.set_num_threads(1)
SPECS = layer_specs("llama-tiny")
LAST = range(3, len(SPECS))  # two blocks, the final norm and the head


def _received() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 16, SPECS[0].config.d_model, generator=generator)
    targets = torch.randint(0, 256, (2, 16), generator=generator)
    return hidden.to(torch.bfloat16).requires_grad_(), targets


def _last_stage() -> PipelineStage:
    return PipelineStage(SPECS, stage=1, layers=LAST, num_stages=2, seed=0, precision="bf16")


def test_a_received_bf16_activation_enters_the_stage_in_fp32_as_in_one_process() -> None:
    hidden, targets = _received()
    (loss,) = _last_stage().forward(0, (hidden,), targets=targets)
    reference = build_layers(SPECS, LAST, seed=0)
    with autocast("bf16", torch.device("cpu")):
        expected = lm_loss(reference(hidden.detach().float()), targets)
    assert torch.equal(loss, expected.detach())


def test_the_input_gradient_goes_back_in_the_exchanged_dtype() -> None:
    hidden, targets = _received()
    stage = _last_stage()
    stage.forward(0, (hidden,), targets=targets)
    (grad,) = stage.backward(0)
    assert grad.dtype == torch.bfloat16 and grad.shape == hidden.shape


def test_norms_get_input_and_weight_of_one_dtype() -> None:
    """RMSNorm given a bf16 input and an fp32 weight takes torch's slower composite path (and
    warns once per process): a widened input never does."""
    hidden, targets = _received()
    stage = _last_stage()
    seen: list[tuple[torch.dtype, torch.dtype]] = []
    for module in stage.module.modules():
        if isinstance(module, nn.RMSNorm):
            module.register_forward_pre_hook(
                lambda norm, args: seen.append((args[0].dtype, norm.weight.dtype))
            )
    stage.forward(0, (hidden,), targets=targets)
    assert len(seen) == 5 and all(given == weight for given, weight in seen)


def test_a_split_forward_keeps_what_a_fused_one_keeps_in_fp32() -> None:
    """W needs each Linear's input and output gradient, not its output: the forward of a
    micro-batch whose backward is split keeps the same bytes as one before a fused B (before,
    every Linear output, the head's logits among them, lived until I), and I + W give B's
    gradients bit for bit."""
    hidden, targets = _received()
    hidden = hidden.detach().float().requires_grad_()
    kept, grads = {}, {}
    for split in (False, True):
        stage = PipelineStage(SPECS, stage=1, layers=LAST, num_stages=2, seed=0, precision="fp32")
        stage.enable_split_backward()
        tracker = MemoryTracker()
        with tracker:
            forward = partial(stage.forward, 0, (hidden,), targets=targets, split=split)
            kept[split] = tracker.measure(forward).net
        if split:
            stage.backward_input(0)
            stage.backward_weight(0)
        else:
            stage.backward(0)
        grads[split] = [p.grad for p in stage.module.parameters()]
    assert kept[True] == kept[False] > 0
    assert all(torch.equal(a, b) for a, b in zip(grads[True], grads[False], strict=True))


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_under_autocast_i_frees_the_graph_and_w_takes_each_linears_input_and_gradient(
    precision: str,
) -> None:
    """W computes each Linear's weight gradient itself (gᵀ·x in the GEMM's dtype: the GEMM
    autograd runs, the same bits), as in fp32, so I frees the graph: a micro-batch awaiting
    its W holds its Linears' inputs in the compute dtype (q, k and v one between them) and
    their outputs' gradients, not every activation. Before, autocast's W went through autograd
    on the graph I retained: llama-tiny's two blocks held 369 kB from I to W, now 130 kB."""
    hidden = torch.randn(2, 16, SPECS[0].config.d_model, generator=torch.Generator()).float()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    grads, freed = {}, {}
    for split in (False, True):
        stage = PipelineStage(
            SPECS, stage=1, layers=range(1, 3), num_stages=3, seed=0, precision=precision
        )
        stage.enable_split_backward()
        received = hidden.clone().requires_grad_()
        tracker = MemoryTracker()
        with tracker, stage.step_scope():
            (out,) = stage.forward(0, (received,), split=split)
            if split:
                backward = partial(stage.backward_input, 0, (torch.ones_like(out),))
                start = tracker.live
                (sent,) = backward()
                freed[split] = start - tracker.live
                pending = stage._pending_w[0].nodes
                assert all(x.dtype == dtype for _, x, _ in pending)
                assert len({id(x) for _, x, _ in pending}) < len(pending)  # q, k, v: one
                stage.backward_weight(0)
            else:
                (sent,) = stage.backward(0, (torch.ones_like(out),))
        grads[split] = [p.grad for p in stage.module.parameters()] + [sent]
    assert freed[True] > 0
    assert all(torch.equal(a, b) for a, b in zip(grads[True], grads[False], strict=True))


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_under_autocast_a_split_forward_keeps_what_a_fused_one_keeps(precision: str) -> None:
    """A split micro-batch's Linears get their inputs narrowed before the GEMM, so the copy
    autograd saves is the one W reads: its forward keeps no wider input besides. Until
    session 54 the record held each norm's fp32 output from F to I (llama-tiny's two blocks in
    bf16 kept 454,144 bytes, a fused forward 421,376)."""
    hidden = torch.randn(2, 16, SPECS[0].config.d_model, generator=torch.Generator()).float()
    kept = {}
    for split in (False, True):
        stage = PipelineStage(
            SPECS, stage=1, layers=range(1, 3), num_stages=3, seed=0, precision=precision
        )
        stage.enable_split_backward()
        tracker = MemoryTracker()
        with tracker, stage.step_scope():
            start = tracker.live
            stage.forward(0, (hidden.clone().requires_grad_(),), split=split)
            kept[split] = tracker.live - start
    assert kept[True] == kept[False]


def test_sequence_parallelism_without_tensor_parallel_ranks_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="sequence_parallel=True .* use a mesh with tp > 1"):
        PipelineStage(SPECS, stage=1, layers=LAST, num_stages=2, seed=0, sequence_parallel=True)
