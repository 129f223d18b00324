"""Real data end to end (issue 22's "done when"): a BPE tokenizer trained here, JSON lines and
nanoGPT's raw format prepared with it, a model shape from a file trained on pp 2 × dp 2 with
packed documents and a validation split, exported, and `transformers` generating greedily
exactly what `meshpipe generate` does."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.cli.main import main
from engine.training.config import TrainConfig
from engine.training.data import load_tokens, prepare
from engine.training.generate import encode_prompt, generate, load_model, model_tokenizer
from engine.training.loop import train
from engine.training.tokenizer import train_tokenizer
from tests.dist.harness import run_ranks

WORDS = ["pipelines", "move", "activations", "forward", "and", "gradients", "back", "while",
         "the", "optimizer", "steps", "every", "stage"]  # fmt: skip
PROMPT = "pipelines move"


def _documents() -> list[str]:
    rng = np.random.default_rng(0)
    return [" ".join(rng.choice(WORDS, 20)) for _ in range(200)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tokenizer/, c.jsonl → t.bin + t.json (prepared), raw.bin (nanoGPT's uint16), model.json."""
    root = tmp_path_factory.mktemp("real")
    docs = _documents()
    tokenizer = train_tokenizer(docs, 300, root / "tokenizer")
    (root / "c.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    info = prepare(root / "c.jsonl", root / "t", tokenizer=root / "tokenizer")
    np.asarray(load_tokens(info.bin_path).tokens, dtype=np.uint16).tofile(root / "raw.bin")
    model = {"family": "gpt", "vocab_size": tokenizer.vocab_size, "n_layer": 2, "n_head": 2,
             "d_model": 32, "max_seq_len": 64}  # fmt: skip
    (root / "model.json").write_text(json.dumps(model))
    return root


SHAPE = {"steps": 2, "global_batch": 4, "micro_batches": 2, "seq_len": 32, "threads": 1}
Trained = tuple[Path, tuple[float, ...], float | None]
"""A training run's checkpoint, losses and final validation loss."""
PACKED = {"pack_documents": True, "val_fraction": 0.1, "eval_every": 1, "eval_batches": 2}
PACKED |= SHAPE


@pytest.fixture(scope="module")
def checkpoint(corpus: Path) -> Trained:
    """pp 2 × dp 2 on the prepared JSON lines, documents packed, 10 % of them held out: the
    checkpoint, the losses and the final validation loss."""
    config = TrainConfig.of(
        model_config=str(corpus / "model.json"),
        data=str(corpus / "t"),
        pp=2,
        dp=2,
        checkpoint_dir=str(corpus / "ckpt"),
        **PACKED,
    )
    losses, val_loss = run_ranks(_train, 4, config)[0]
    return corpus / "ckpt", losses, val_loss


def _train(
    rank: int, world_size: int, config: TrainConfig
) -> tuple[tuple[float, ...], float | None]:
    result = train(config, progress=False)
    return result.losses, result.val_loss


def test_packed_documents_with_validation_on_pp2_dp2_train_as_one_process(
    corpus: Path, checkpoint: Trained
) -> None:
    config = TrainConfig.of(
        model_config=str(corpus / "model.json"), data=str(corpus / "t"), **PACKED
    )
    result = train(config, progress=False)
    assert result.losses == pytest.approx(checkpoint[1], rel=1e-5)
    assert checkpoint[2] is not None
    assert result.val_loss == pytest.approx(checkpoint[2], rel=1e-5)


def test_nanogpt_tokens_train_as_the_prepared_file(corpus: Path) -> None:
    """The raw uint16 file holds the prepared file's ids (no header, no documents): drawn in
    the same random windows, the two train alike."""
    vocab = json.loads((corpus / "model.json").read_text())["vocab_size"]
    shape = {"model_config": str(corpus / "model.json"), "data_order": "random", **SHAPE}
    raw = TrainConfig.of(
        data=f"nanogpt:{corpus / 'raw.bin'}",
        vocab_size=vocab,
        tokenizer=str(corpus / "tokenizer"),
        **shape,
    )
    prepared = TrainConfig.of(data=str(corpus / "t"), **shape)
    assert train(raw, progress=False).losses == train(prepared, progress=False).losses


def test_transformers_greedy_generation_equals_meshpipe_generate(
    checkpoint: Trained, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert main(["export", "--checkpoint", str(checkpoint[0]), "--out", str(tmp_path / "hf")]) == 0
    hf_tokenizer = AutoTokenizer.from_pretrained(tmp_path / "hf")
    hf_model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    ids = hf_tokenizer(PROMPT, return_tensors="pt")["input_ids"]
    theirs = hf_model.generate(ids, max_new_tokens=12, do_sample=False)[0].tolist()

    model, config = load_model(checkpoint[0])
    tokenizer = model_tokenizer(checkpoint[0], config)
    prompt = encode_prompt(tokenizer, PROMPT)
    ours = generate(model, prompt, max_new_tokens=12, context=64, vocab=tokenizer.vocab_size)
    assert ours.tolist() == theirs
    capsys.readouterr()
    argv = ["generate", "--checkpoint", str(checkpoint[0]), "--prompt", PROMPT]
    assert main([*argv, "--max-new-tokens", "12"]) == 0
    assert capsys.readouterr().out.rstrip("\n") == hf_tokenizer.decode(theirs)
    assert torch.equal(prompt, ids[0])
    imported = tmp_path / "imported"
    assert main(["import", str(tmp_path / "hf"), "--out", str(imported)]) == 0
    assert model_tokenizer(imported, config).sha256 == tokenizer.sha256


def test_generate_refuses_a_tokenizer_other_than_the_models(
    checkpoint: Trained, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["generate", "--checkpoint", str(checkpoint[0]), "--prompt", PROMPT]
    with pytest.raises(SystemExit) as exit_:
        main([*argv, "--tokenizer", "bytes"])
    assert exit_.value.code == 2
    assert "--tokenizer bytes is not the tokenizer" in capsys.readouterr().err


def test_starting_from_a_model_of_another_tokenizer_is_refused_before_any_rank(
    corpus: Path, checkpoint: Trained, capsys: pytest.CaptureFixture[str]
) -> None:
    byte_tokens = prepare(corpus / "c.jsonl", corpus / "bytes").bin_path
    argv = ["train", "--model-config", str(corpus / "model.json"), "--data", str(byte_tokens),
            "--init-from", str(checkpoint[0]), "--pp", "2", "--seq-len", "32"]  # fmt: skip
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"--init-from {checkpoint[0]} was trained with the tokenizer" in err
    assert "meshpipe data prepare SOURCE --tokenizer" in err
