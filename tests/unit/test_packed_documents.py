"""Packed documents in the models: positions restart and attention stops at each document."""

from __future__ import annotations

import pytest
import torch

from models import build_layers, document_scope, layer_specs
from models.documents import document_mask, document_positions

DOCS = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2]])


def test_positions_restart_at_each_document() -> None:
    assert document_positions(DOCS).tolist() == [[0, 1, 2, 0, 1, 0, 1, 2]]


def test_mask_is_causal_within_a_document_and_closed_across() -> None:
    mask = document_mask(DOCS)[0, 0]
    assert mask[4].tolist() == [False, False, False, True, True, False, False, False]
    assert mask[2].tolist() == [True, True, True, False, False, False, False, False]


def test_mask_keeps_a_sliding_window_inside_a_document() -> None:
    mask = document_mask(torch.zeros(1, 5, dtype=torch.long), window=2)[0, 0]
    assert mask[4].tolist() == [False, False, False, True, True]


@pytest.mark.parametrize("model", ["gpt-tiny", "llama-tiny"])
def test_a_token_cannot_attend_across_a_document_boundary(model: str) -> None:
    """Changing the first document changes none of the second's logits."""
    net = build_layers(layer_specs(model), seed=0)
    tokens = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(0))
    other = tokens.clone()
    other[0, :3] = (other[0, :3] + 1) % 256
    with torch.no_grad(), document_scope(DOCS):
        before, after = net(tokens), net(other)
    assert not torch.allclose(before[0, :3], after[0, :3])
    torch.testing.assert_close(before[0, 3:], after[0, 3:], rtol=0, atol=1e-6)


@pytest.mark.parametrize("model", ["gpt-tiny", "llama-tiny"])
def test_a_packed_document_scores_as_it_would_alone(model: str) -> None:
    """Positions restart too: the second document's logits equal those of it run alone."""
    net = build_layers(layer_specs(model), seed=0)
    tokens = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        alone = net(tokens[:, 3:5])
        with document_scope(DOCS):
            packed = net(tokens)
    torch.testing.assert_close(packed[:, 3:5], alone, rtol=0, atol=1e-5)


def test_the_scope_refuses_ids_of_the_wrong_rank() -> None:
    scope = document_scope(torch.zeros(8, dtype=torch.long))
    with pytest.raises(ValueError, match=r"give a \(batch, seq\) tensor"), scope:
        pass
