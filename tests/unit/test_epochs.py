"""Specifications of the data order: epochs without replacement, documents, validation splits,
packed document ids, and resuming them."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest

from engine.training.batches import BatchLoader
from engine.training.data import TokenDataset, load_tokens
from engine.training.documents import documents_of, split_validation

EOS = 0


def _token_file(path: Path, tokens: list[int], eos_id: int | None = None) -> TokenDataset:
    path.with_suffix(".bin").write_bytes(np.asarray(tokens, dtype=np.uint8).tobytes())
    header = {
        "format": "meshpipe-tokens",
        "version": 1,
        "dtype": "uint8",
        "vocab_size": 256,
        "num_tokens": len(tokens),
    }
    if eos_id is not None:
        header["eos_id"] = eos_id
    path.with_suffix(".json").write_text(json.dumps(header))
    return load_tokens(path)


@pytest.fixture
def stream(tmp_path: Path) -> TokenDataset:
    """241 distinct tokens: 15 windows of 16 (+1), each named by its first token."""
    return _token_file(tmp_path / "stream", list(range(241)))


@pytest.fixture
def docs(tmp_path: Path) -> TokenDataset:
    """40 documents of 2 to 9 tokens, document k made of token k + 1 and ending with EOS."""
    lengths = np.random.default_rng(3).integers(2, 10, size=40)
    tokens = [t for k, n in enumerate(lengths) for t in [k + 1] * (n - 1) + [EOS]]
    return _token_file(tmp_path / "docs", tokens, eos_id=EOS)


def _firsts(loader: BatchLoader, steps: range) -> list[int]:
    return [int(t) for step in steps for t in loader.batch_at(step)[0][:, 0]]


def test_an_epoch_draws_every_window_once(stream: TokenDataset) -> None:
    loader = BatchLoader(stream, seq_len=16, global_batch=5, seed=0)
    assert loader.windows_per_epoch == 15
    assert sorted(_firsts(loader, range(3))) == list(range(0, 240, 16))


def test_the_next_epoch_draws_them_again_in_another_order(stream: TokenDataset) -> None:
    loader = BatchLoader(stream, seq_len=16, global_batch=5, seed=0)
    first, second = _firsts(loader, range(3)), _firsts(loader, range(3, 6))
    assert sorted(second) == sorted(first) and second != first


def test_a_batch_spanning_two_epochs_takes_the_rest_then_the_next(stream: TokenDataset) -> None:
    loader = BatchLoader(stream, seq_len=16, global_batch=4, seed=0)  # 15 = 4 + 4 + 4 + 3
    drawn = _firsts(loader, range(4))
    assert sorted(drawn[:15]) == list(range(0, 240, 16))


def test_the_random_order_draws_windows_as_before_epochs(stream: TokenDataset) -> None:
    loader = BatchLoader(stream, seq_len=16, global_batch=4, seed=5, order="random")
    rng = np.random.default_rng([5, 2])
    starts = rng.integers(0, 241 - 16, size=4)
    assert loader.batch_at(2)[0][:, 0].tolist() == starts.tolist()


def test_documents_end_after_each_eos(docs: TokenDataset) -> None:
    found = documents_of(docs)
    assert len(found) == 40
    ends = found.starts + found.lengths - 1
    assert (docs.tokens[ends] == EOS).all()


def test_an_epoch_shuffles_documents_and_keeps_them_whole(docs: TokenDataset) -> None:
    loader = BatchLoader(docs, seq_len=8, global_batch=4, seed=0)
    inputs, _ = loader.batch_at(0)
    for row in inputs.tolist():
        for a, b in itertools.pairwise(row):
            assert b == a or a == EOS or b == EOS  # a document's tokens stay together


def test_packed_ids_change_exactly_after_each_eos(docs: TokenDataset) -> None:
    loader = BatchLoader(docs, seq_len=8, global_batch=4, seed=0, pack_documents=True)
    batch = loader.sample(1)
    assert batch.documents is not None
    starts = (batch.documents[:, 1:] != batch.documents[:, :-1]).numpy()
    assert (starts == (batch.inputs[:, :-1] == EOS).numpy()).all()


def test_packing_a_file_without_eos_is_refused_naming_the_fix(stream: TokenDataset) -> None:
    with pytest.raises(ValueError, match="has no eos_id .* tokenizer that has an EOS token"):
        BatchLoader(stream, seq_len=16, global_batch=4, seed=0, pack_documents=True)


def test_the_validation_split_holds_out_whole_documents_whatever_the_seed(
    docs: TokenDataset,
) -> None:
    train, val = split_validation(documents_of(docs), 0.1)
    assert len(val) == 4 and len(train) == 36
    assert not set(val.starts.tolist()) & set(train.starts.tolist())
    again = split_validation(documents_of(docs), 0.1)[1]
    assert again.starts.tolist() == val.starts.tolist()


def test_a_stream_holds_out_its_last_tokens(stream: TokenDataset) -> None:
    train, val = split_validation(documents_of(stream), 0.25)
    assert (train.starts.tolist(), train.lengths.tolist()) == ([0], [180])
    assert (val.starts.tolist(), val.lengths.tolist()) == ([180], [61])


def test_a_loader_over_the_split_never_draws_held_out_tokens(docs: TokenDataset) -> None:
    train, val = split_validation(documents_of(docs), 0.25)
    held = {int(docs.tokens[s]) for s in val.starts}
    loader = BatchLoader(docs, seq_len=8, global_batch=4, seed=0, documents=train)
    drawn = {t for step in range(10) for t in loader.batch_at(step)[0].flatten().tolist()}
    assert not drawn & held


def test_resume_refuses_another_order(stream: TokenDataset) -> None:
    state = BatchLoader(stream, seq_len=16, global_batch=4, seed=0, order="random").state_dict()
    with pytest.raises(ValueError, match="resume with --data-order random"):
        BatchLoader(stream, seq_len=16, global_batch=4, seed=0).load_state_dict(state)


def test_a_state_from_before_epochs_resumes_only_in_random_order(stream: TokenDataset) -> None:
    state = BatchLoader(stream, seq_len=16, global_batch=4, seed=0).state_dict()
    del state["order"], state["drawn_from"]
    with pytest.raises(ValueError, match="'random' order"):
        BatchLoader(stream, seq_len=16, global_batch=4, seed=0).load_state_dict(state)
    BatchLoader(stream, seq_len=16, global_batch=4, seed=0, order="random").load_state_dict(state)


def test_resume_refuses_another_validation_split(docs: TokenDataset) -> None:
    train, _ = split_validation(documents_of(docs), 0.25)
    state = BatchLoader(docs, seq_len=8, global_batch=4, seed=0, documents=train).state_dict()
    with pytest.raises(ValueError, match="the validation split changed"):
        BatchLoader(docs, seq_len=8, global_batch=4, seed=0).load_state_dict(state)
