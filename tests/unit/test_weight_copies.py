"""`WeightCopies`: a step's bf16 Linear weights, gradients added into the fp32 masters with the
bits autocast's own casts give."""

from __future__ import annotations

import torch
from torch import nn

from engine.runtime.precision import step_casts
from engine.runtime.weight_copies import WeightCopies

torch.set_num_threads(1)


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.Linear(32, 8, bias=False))


def _grads_after_two_micro_batches(model: nn.Sequential, copies: WeightCopies | None) -> list:
    inputs = torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(1))
    with step_casts("bf16", torch.device("cpu")):
        for x in inputs:
            if copies is not None:
                copies.install()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(x).float().square().mean()
            loss.backward()
    if copies is not None:
        copies.restore()
    return [p.grad for p in model.parameters()]


def test_copy_gradients_reach_the_fp32_masters_with_the_bits_autocast_gives() -> None:
    expected = _grads_after_two_micro_batches(_model(), None)
    model = _model()
    got = _grads_after_two_micro_batches(model, WeightCopies(model, torch.bfloat16))
    for a, b in zip(got, expected, strict=True):
        assert a.dtype == torch.float32
        assert torch.equal(a, b)


def test_installed_copies_replace_only_linear_parameters_until_restored() -> None:
    model = _model()
    masters = list(model.parameters())
    copies = WeightCopies(model, torch.bfloat16)
    copies.install()
    dtypes = [p.dtype for p in model.parameters()]
    assert dtypes == [torch.bfloat16, torch.bfloat16, torch.float32, torch.float32, torch.bfloat16]
    assert [copies.master(p) for p in model.parameters()] == masters
    copies.restore()
    assert list(model.parameters()) == masters


def test_installing_twice_in_a_step_keeps_the_first_copies() -> None:
    model = _model()
    copies = WeightCopies(model, torch.bfloat16)
    copies.install()
    first = model[0].weight
    copies.install()
    assert model[0].weight is first


def test_a_weight_shared_by_two_linears_gets_one_copy() -> None:
    model = nn.Sequential(nn.Linear(8, 8, bias=False), nn.Linear(8, 8, bias=False))
    model[1].weight = model[0].weight
    copies = WeightCopies(model, torch.bfloat16)
    copies.install()
    assert model[0].weight is model[1].weight
    assert model[0].weight.dtype == torch.bfloat16


def test_parameters_replaced_after_construction_are_the_ones_copied_and_restored() -> None:
    model = _model()
    copies = WeightCopies(model, torch.bfloat16)
    replacement = nn.Parameter(torch.zeros(8, 32))
    model[2].weight = replacement
    copies.install()
    assert torch.equal(model[2].weight, torch.zeros(8, 32, dtype=torch.bfloat16))
    copies.restore()
    assert model[2].weight is replacement


def test_a_weight_a_linear_shares_with_an_embedding_is_left_to_autocast() -> None:
    """Autograd sums a tied weight's two gradients before adding them to `.grad`; adding the
    Linear's part on its own would round differently, so the tie keeps its master."""
    model = nn.Sequential(nn.Embedding(8, 4), nn.Linear(4, 8, bias=False))
    model[1].weight = model[0].weight
    copies = WeightCopies(model, torch.bfloat16)
    copies.install()
    assert model[1].weight is model[0].weight
    assert model[1].weight.dtype == torch.float32
