"""Specifications of real data: BPE tokenizers, token files with documents, nanoGPT's raw
files, model shapes from files, and bad input refused with the file and the fix."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from engine.cli.main import main
from engine.config import ModelChoice
from engine.training.data import load_tokens, prepare
from engine.training.generate import encode_prompt
from engine.training.run_data import open_training_data
from engine.training.tokenizer import EOS_TOKEN, HFTokenizer, load_tokenizer, train_tokenizer
from models import GPTConfig, LlamaConfig

WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while",
         "pipelines", "move", "activations"]  # fmt: skip


def _corpus(n: int = 60) -> list[str]:
    rng = np.random.default_rng(0)
    return [" ".join(rng.choice(WORDS, 12)) for _ in range(n)]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tok")
    train_tokenizer(_corpus(), 300, out)
    return out


def _jsonl(path: Path, texts: list[str], field: str = "text") -> Path:
    path.write_text("".join(json.dumps({field: t, "id": i}) + "\n" for i, t in enumerate(texts)))
    return path


def test_a_trained_bpe_tokenizer_loads_in_transformers_with_the_same_ids(
    tokenizer_dir: Path,
) -> None:
    from transformers import AutoTokenizer

    ours = load_tokenizer(tokenizer_dir)
    theirs = AutoTokenizer.from_pretrained(tokenizer_dir)
    text = "the lazy fox moves activations, ünïcode too"
    assert theirs(text)["input_ids"] == ours.encode(text)
    assert theirs.eos_token == EOS_TOKEN and theirs.eos_token_id == ours.eos_id
    assert ours.decode(ours.encode(text)) == text


def test_a_vocabulary_without_room_for_bytes_and_eos_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="at least 257"):
        train_tokenizer(["text"], 256, tmp_path)


def test_json_lines_become_documents_each_ended_by_eos(tokenizer_dir: Path, tmp_path: Path) -> None:
    texts = _corpus(5)
    info = prepare(_jsonl(tmp_path / "c.jsonl", texts), tmp_path / "t", tokenizer=tokenizer_dir)
    tok = load_tokenizer(tokenizer_dir)
    expected = [i for t in texts for i in [*tok.encode(t), tok.eos_id]]
    assert load_tokens(info.bin_path).tokens.tolist() == expected
    header = json.loads((tmp_path / "t.json").read_text())
    assert (header["dtype"], header["eos_id"], header["documents"]) == ("uint16", tok.eos_id, 5)
    assert header["tokenizer"] == {"file": "t.tokenizer.json", "sha256": tok.sha256}
    assert info.tokenizer == tmp_path / "t.tokenizer.json"


@pytest.mark.parametrize(
    ("vocab", "dtype"), [(256, "uint8"), (257, "uint16"), (65536, "uint16"), (65537, "uint32")]
)
def test_the_token_dtype_is_the_smallest_that_holds_the_vocabulary(
    tmp_path: Path, vocab: int, dtype: str
) -> None:
    (tmp_path / "t.bin").write_bytes(np.zeros(4, dtype).tobytes())
    header = {"format": "meshpipe-tokens", "version": 2, "dtype": dtype, "vocab_size": vocab,
              "tokenizer": "bytes", "num_tokens": 4}  # fmt: skip
    (tmp_path / "t.json").write_text(json.dumps(header))
    assert load_tokens(tmp_path / "t").tokens.dtype == np.dtype(dtype)


def test_a_header_whose_dtype_is_too_small_for_its_vocabulary_blames_the_vocabulary(
    tmp_path: Path,
) -> None:
    (tmp_path / "t.bin").write_bytes(bytes(4))
    header = {"format": "meshpipe-tokens", "version": 2, "dtype": "uint8", "vocab_size": 300,
              "num_tokens": 4}  # fmt: skip
    (tmp_path / "t.json").write_text(json.dumps(header))
    too_small = r"vocab_size=300, more token ids than its dtype 'uint8' holds .* dtype 'uint16'"
    with pytest.raises(ValueError, match=too_small + ".*prepare"):
        load_tokens(tmp_path / "t")


def test_a_missing_text_field_names_the_file_line_and_flag(tmp_path: Path) -> None:
    source = _jsonl(tmp_path / "c.jsonl", ["hello"], field="body")
    refused = r"c.jsonl line 1 has no text field 'text' \(its fields: body, id\): pass --text-field"
    with pytest.raises(ValueError, match=refused):
        prepare(source, tmp_path / "t")
    assert prepare(source, tmp_path / "t", text_field="body").num_tokens == 5


def test_nanogpt_raw_uint16_is_read_with_the_vocabulary_given(tmp_path: Path) -> None:
    np.arange(100, dtype=np.uint16).tofile(tmp_path / "train.bin")
    data = load_tokens(f"nanogpt:{tmp_path / 'train.bin'}", vocab_size=100)
    assert data.tokens.tolist() == list(range(100))
    assert (data.info.dtype, data.info.eos_id, data.info.json_path) == ("uint16", None, None)


def test_a_headerless_bin_is_recognised_as_nanogpt_and_the_fix_named(tmp_path: Path) -> None:
    np.arange(100, dtype=np.uint16).tofile(tmp_path / "train.bin")
    with pytest.raises(ValueError, match=r"nanoGPT's raw uint16.*--data nanogpt:.*--vocab-size"):
        load_tokens(tmp_path / "train.bin")
    assert len(load_tokens(tmp_path / "train.bin", vocab_size=100)) == 100


def test_a_token_id_outside_the_vocabulary_names_the_file_and_position(tmp_path: Path) -> None:
    np.array([1, 2, 70, 3], dtype=np.uint16).tofile(tmp_path / "train.bin")
    refused = r"train.bin holds token id 70 \(first out-of-range id at position 2\), outside"
    with pytest.raises(ValueError, match=refused + r" its vocabulary of 65: pass the --vocab-size"):
        load_tokens(f"nanogpt:{tmp_path / 'train.bin'}", vocab_size=65)


def test_data_with_a_larger_vocabulary_than_the_model_is_refused(
    tokenizer_dir: Path, tmp_path: Path
) -> None:
    info = prepare(_jsonl(tmp_path / "c.jsonl", ["the fox"]), tmp_path / "t",
                   tokenizer=tokenizer_dir)  # fmt: skip
    with pytest.raises(ValueError, match=r"vocabulary 300 but the model embeds only 256"):
        open_training_data(info.bin_path, vocab_size=None, tokenizer=None, model_vocab=256)


def test_an_edited_tokenizer_copy_is_refused(tokenizer_dir: Path, tmp_path: Path) -> None:
    prepare(_jsonl(tmp_path / "c.jsonl", ["the fox"]), tmp_path / "t", tokenizer=tokenizer_dir)
    copy = tmp_path / "t.tokenizer.json"
    copy.write_text(copy.read_text() + " ")
    with pytest.raises(ValueError, match="is not the one .* was prepared with"):
        load_tokens(tmp_path / "t")


def test_a_tokenizer_other_than_the_datas_is_refused(tokenizer_dir: Path, tmp_path: Path) -> None:
    info = prepare(_jsonl(tmp_path / "c.jsonl", ["the fox"]), tmp_path / "t")
    with pytest.raises(ValueError, match="not the tokenizer .* was prepared with"):
        open_training_data(info.bin_path, vocab_size=None, tokenizer=str(tokenizer_dir),
                           model_vocab=512)  # fmt: skip


def test_a_prompt_the_tokenizer_cannot_encode_is_refused(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = Tokenizer(models.WordLevel({"[UNK]": 0, "fox": 1}, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = HFTokenizer(words.to_str(), "words.json")
    assert encode_prompt(tokenizer, "fox fox").tolist() == [1, 1]
    with pytest.raises(ValueError, match="cannot encode"):
        encode_prompt(tokenizer, "fox cat")


def test_parquet_rows_are_documents_as_json_lines_are(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = ["first document", "second one", "third"]
    pq.write_table(pa.table({"body": texts, "id": [1, 2, 3]}), tmp_path / "c.parquet")
    (tmp_path / "c.jsonl").write_text("".join(json.dumps({"body": t}) + "\n" for t in texts))
    parquet = prepare(tmp_path / "c.parquet", tmp_path / "p", text_field="body")
    lines = prepare(tmp_path / "c.jsonl", tmp_path / "j", text_field="body")
    assert parquet.num_tokens == lines.num_tokens
    assert np.array_equal(load_tokens(parquet.bin_path).tokens, load_tokens(lines.bin_path).tokens)


def test_parquet_without_pyarrow_names_the_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)  # import fails as uninstalled
    (tmp_path / "c.parquet").write_bytes(b"PAR1")
    with pytest.raises(ValueError, match="c.parquet is Parquet, which needs pyarrow: pip install"):
        prepare(tmp_path / "c.parquet", tmp_path / "t")


def test_a_model_config_file_builds_gpt_and_llama(tmp_path: Path) -> None:
    gpt = {"family": "gpt", "vocab_size": 300, "n_layer": 2, "n_head": 2, "d_model": 32,
           "max_seq_len": 64}  # fmt: skip
    (tmp_path / "g.json").write_text(json.dumps(gpt))
    assert ModelChoice(model_config=str(tmp_path / "g.json")).config() == GPTConfig(
        vocab_size=300, n_layer=2, n_head=2, d_model=32, max_seq_len=64
    )
    llama = {"family": "llama", "vocab_size": 300, "n_layer": 2, "n_head": 4, "n_kv_head": 2,
             "d_model": 32, "ffn_hidden": 64, "max_seq_len": 64}  # fmt: skip
    (tmp_path / "l.json").write_text(json.dumps(llama))
    assert isinstance(ModelChoice(model_config=str(tmp_path / "l.json")).config(), LlamaConfig)


def test_an_unknown_model_field_is_refused_by_name(tmp_path: Path) -> None:
    config = {"family": "gpt", "vocab_size": 300, "n_layer": 2, "n_head": 2, "d_model": 32,
              "max_seq_len": 64, "n_embd": 32}  # fmt: skip
    (tmp_path / "g.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"gpt models have no fields \['n_embd'\]"):
        ModelChoice(model_config=str(tmp_path / "g.json"))


def test_model_hf_dir_takes_the_shape_of_a_hugging_face_config(tmp_path: Path) -> None:
    hf = {"model_type": "gpt2", "vocab_size": 300, "n_positions": 64, "n_embd": 32,
          "n_layer": 2, "n_head": 2}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(hf))
    config = ModelChoice(model=f"hf:{tmp_path}").config()
    assert (config.vocab_size, config.n_layer, config.d_model) == (300, 2, 32)


def test_model_and_model_config_together_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="give one of them"):
        ModelChoice(model="gpt-small", model_config=str(tmp_path / "g.json"))


def test_bad_data_is_refused_before_any_rank_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    np.array([1, 2, 300], dtype=np.uint16).tofile(tmp_path / "train.bin")
    data = f"nanogpt:{tmp_path / 'train.bin'}"
    argv = ["train", "--pp", "2", "--steps", "1", "--data", data, "--vocab-size", "256"]
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    assert "train.bin holds token id 300" in capsys.readouterr().err


def test_cli_trains_a_tokenizer_and_prepares_with_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = _jsonl(tmp_path / "c.jsonl", _corpus())
    assert main(["data", "train-tokenizer", str(source), "--vocab-size", "280",
                 "--out", str(tmp_path / "tok")]) == 0  # fmt: skip
    assert main(["data", "prepare", str(source), "--tokenizer", str(tmp_path / "tok"),
                 "--out", str(tmp_path / "t")]) == 0  # fmt: skip
    tokenizer = load_tokenizer(tmp_path / "tok")
    assert load_tokens(tmp_path / "t").info.vocab_size == tokenizer.vocab_size
    assert "--tokenizer" in capsys.readouterr().out
