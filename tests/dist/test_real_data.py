"""Real data end to end: a BPE tokenizer trained here, JSON lines and nanoGPT's raw format
prepared with it, a model shape from a file trained on 2 pipeline ranks, exported, and
`transformers` generating greedily exactly what `meshpipe generate` does."""

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


@pytest.fixture(scope="module")
def checkpoint(corpus: Path) -> tuple[Path, float]:
    """pp 2 on the nanoGPT file (with the tokenizer it was made with) and its final loss."""
    vocab = json.loads((corpus / "model.json").read_text())["vocab_size"]
    config = TrainConfig.of(
        model_config=str(corpus / "model.json"),
        data=f"nanogpt:{corpus / 'raw.bin'}",
        vocab_size=vocab,
        tokenizer=str(corpus / "tokenizer"),
        pp=2,
        checkpoint_dir=str(corpus / "ckpt"),
        **SHAPE,
    )
    return corpus / "ckpt", run_ranks(_train, 2, config)[0][-1]


def _train(rank: int, world_size: int, config: TrainConfig) -> tuple[float, ...]:
    return train(config, progress=False).losses


def test_nanogpt_tokens_on_two_stages_train_as_the_prepared_file_in_one_process(
    corpus: Path, checkpoint: tuple[Path, float]
) -> None:
    config = TrainConfig.of(
        model_config=str(corpus / "model.json"), data=str(corpus / "t"), **SHAPE
    )
    assert train(config, progress=False).losses[-1] == pytest.approx(checkpoint[1], abs=1e-4)


def test_transformers_greedy_generation_equals_meshpipe_generate(
    checkpoint: tuple[Path, float], tmp_path: Path, capsys: pytest.CaptureFixture[str]
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
    checkpoint: tuple[Path, float], capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["generate", "--checkpoint", str(checkpoint[0]), "--prompt", PROMPT]
    with pytest.raises(SystemExit) as exit_:
        main([*argv, "--tokenizer", "bytes"])
    assert exit_.value.code == 2
    assert "--tokenizer bytes is not the tokenizer" in capsys.readouterr().err


def test_starting_from_a_model_of_another_tokenizer_is_refused_before_any_rank(
    corpus: Path, checkpoint: tuple[Path, float], capsys: pytest.CaptureFixture[str]
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
