"""Bad input is refused by name before any rank starts: a token header whose vocabulary
does not fit its dtype, bytes that are not text, a token file or --init-from weights that do
not fit the model."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import engine.comm.launch
import engine.training.workers
from engine.checkpoint.save import save_weights
from engine.training.data import load_tokens, prepare
from models import MODEL_CONFIGS
from tests.unit.cli_error import cli_error

PP2 = ["train", "--model", "gpt-tiny", "--pp", "2", "--steps", "1", "--seq-len", "16",
       "--global-batch", "4"]  # fmt: skip


@pytest.fixture(autouse=True)
def no_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every refusal here comes before a rank starts."""

    def started(*_: object, **__: object) -> None:
        raise AssertionError("ranks started")

    monkeypatch.setattr(engine.comm.launch, "launch_local", started)
    monkeypatch.setattr(engine.training.workers, "train_worker", started)


def _tokens(prefix: Path, *, vocab: int, dtype: str, count: int = 4096) -> Path:
    ids = (np.arange(count) % min(vocab, 256)).astype(dtype)
    prefix.with_suffix(".bin").write_bytes(ids.tobytes())
    header = {"format": "meshpipe-tokens", "version": 1, "dtype": dtype, "vocab_size": vocab,
              "tokenizer": "bytes", "num_tokens": count}  # fmt: skip
    prefix.with_suffix(".json").write_text(json.dumps(header))
    return prefix


def test_a_vocabulary_too_big_for_its_dtype_is_blamed_with_the_dtype_it_needs(
    tmp_path: Path,
) -> None:
    prefix = _tokens(tmp_path / "tok", vocab=1000, dtype="uint8")
    with pytest.raises(ValueError, match=r"vocab_size=1000, more token ids than its dtype 'uint8' "
                       r"holds \(256\).*need dtype 'uint16'"):  # fmt: skip
        load_tokens(prefix)


def test_random_bytes_are_refused_by_data_prepare_naming_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    blob = tmp_path / "blob.txt"
    blob.write_bytes(bytes(range(256)) * 4)
    status, err = cli_error(["data", "prepare", str(blob), "--out", str(tmp_path / "t")], capsys)
    assert status == 2
    assert f"source '{blob}' is not UTF-8 text (byte 128 is 0x80)" in err
    assert not (tmp_path / "t.bin").exists()


def test_utf8_text_is_still_prepared(tmp_path: Path) -> None:
    text = "héllo wörld ✓\n"
    (tmp_path / "text.txt").write_text(text, encoding="utf-8")
    assert prepare(tmp_path / "text.txt", tmp_path / "t").num_tokens == len(text.encode())


def test_a_token_file_with_a_larger_vocabulary_than_the_model_is_refused_before_the_ranks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prefix = _tokens(tmp_path / "tok", vocab=1000, dtype="uint16")
    status, err = cli_error([*PP2, "--data", str(prefix)], capsys)
    assert status == 2
    assert "has vocabulary 1000 but gpt-tiny embeds only 256 tokens" in err


def test_init_from_weights_of_another_model_are_refused_before_the_ranks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    llama = MODEL_CONFIGS["llama-tiny"]
    save_weights(tmp_path / "llama", llama.layer_specs(), {"layers.0.weight": torch.zeros(1)})
    status, err = cli_error([*PP2, "--init-from", str(tmp_path / "llama")], capsys)
    assert status == 2
    assert "but the run builds" in err and "pick the matching --model" in err
