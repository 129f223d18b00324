"""Specifications of engine.data: tokenizer, token files, default corpus, batch loader."""

from __future__ import annotations

import hashlib
import json
import os
import stat
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.cli.main import main
from engine.training.batches import BatchLoader
from engine.training.data import (
    TokenDataset,
    decode,
    default_corpus,
    encode,
    load_tokens,
    prepare,
)


def _write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


@pytest.fixture
def dataset(tmp_path: Path) -> TokenDataset:
    text = "".join(f"line {i}: the quick brown fox\n" for i in range(200))
    info = prepare(_write(tmp_path / "src", {"a.txt": text}), tmp_path / "tokens")
    return load_tokens(info.bin_path)


def _loader(dataset: TokenDataset, **overrides: int) -> BatchLoader:
    kwargs = {"seq_len": 16, "global_batch": 8, "seed": 0} | overrides
    return BatchLoader(dataset, **kwargs)


def test_encode_decode_round_trips_unicode() -> None:
    text = "héllo, 世界 🚀\n"
    tokens = encode(text)
    assert tokens.dtype == np.uint8
    assert decode(tokens) == text
    assert decode(torch.from_numpy(tokens.astype(np.int64))) == text


def test_decode_replaces_invalid_utf8() -> None:
    assert decode(encode("é")[:1]) == "\ufffd"


def test_prepare_joins_folder_files_sorted_by_relative_path_parts(tmp_path: Path) -> None:
    src = _write(tmp_path / "src", {"b.txt": "B", "a.py": "A", "a/z.md": "AZ", "skip.bin": "X"})
    info = prepare(src, tmp_path / "out.bin")
    assert decode(np.fromfile(info.bin_path, dtype=np.uint8)) == "AZ\nA\nB"


def test_prepare_writes_header_that_describes_the_bin(tmp_path: Path) -> None:
    src = _write(tmp_path / "src", {"a.txt": "hello", "b.rst": "world"})
    info = prepare(src, tmp_path / "out")
    header = json.loads(info.json_path.read_text())
    assert header == {
        "format": "meshpipe-tokens",
        "version": 2,
        "dtype": "uint8",
        "vocab_size": 256,
        "tokenizer": "bytes",
        "eos_id": None,
        "num_tokens": 11,
        "sha256": hashlib.sha256(b"hello\nworld").hexdigest(),
        "sources": 2,
        "documents": 2,
    }
    assert info.bin_path.stat().st_size == info.num_tokens == 11
    assert (info.bin_path.name, info.json_path.name) == ("out.bin", "out.json")


def test_prepare_respects_suffixes(tmp_path: Path) -> None:
    src = _write(tmp_path / "src", {"a.txt": "A", "b.log": "B"})
    info = prepare(src, tmp_path / "out", suffixes=(".log",))
    assert decode(load_tokens(info.bin_path).tokens) == "B"


def test_max_bytes_truncates_to_exactly_the_cap(tmp_path: Path) -> None:
    src = _write(tmp_path / "src", {"a.txt": "aaaa", "b.txt": "bbbb", "c.txt": "cccc"})
    info = prepare(src, tmp_path / "out", max_bytes=7)
    assert info.num_tokens == 7
    assert decode(load_tokens(info.bin_path).tokens) == "aaaa\nbb"
    assert json.loads(info.json_path.read_text())["sources"] == 2


def test_prepare_leaves_no_temp_files(tmp_path: Path) -> None:
    src = _write(tmp_path / "src", {"a.txt": "hello"})
    prepare(src, tmp_path / "out" / "tokens")
    prepare(src, tmp_path / "out" / "tokens")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["tokens.bin", "tokens.json"]


def test_load_tokens_accepts_bin_json_or_prefix(tmp_path: Path) -> None:
    info = prepare(_write(tmp_path / "src", {"a.txt": "abc"}), tmp_path / "out")
    for path in (info.bin_path, info.json_path, tmp_path / "out"):
        assert load_tokens(path).info == info


def test_default_corpus_is_cached_and_large(tmp_path: Path) -> None:
    first = default_corpus(tmp_path, max_bytes=2_000_000)
    mtime = first.bin_path.stat().st_mtime_ns
    second = default_corpus(tmp_path, max_bytes=2_000_000)
    assert second == first
    assert second.bin_path.stat().st_mtime_ns == mtime
    assert first.num_tokens == 2_000_000
    assert "3." in first.bin_path.name and "2000000" in first.bin_path.name


def test_default_corpus_is_python_source(tmp_path: Path) -> None:
    info = default_corpus(tmp_path, max_bytes=2_000_000)
    text = decode(load_tokens(info.bin_path).tokens[:200_000])
    assert "def " in text and "import " in text


def test_loader_is_deterministic_in_the_seed(dataset: TokenDataset) -> None:
    a, b, c = _loader(dataset), _loader(dataset), _loader(dataset, seed=1)
    for _ in range(3):
        xa, ya = a.next_batch()
        xb, yb = b.next_batch()
        xc, _ = c.next_batch()
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
        assert not torch.equal(xa, xc)


def test_batches_differ_between_steps(dataset: TokenDataset) -> None:
    loader = _loader(dataset)
    assert not torch.equal(loader.next_batch()[0], loader.next_batch()[0])


def test_targets_are_inputs_shifted_by_one(dataset: TokenDataset) -> None:
    inputs, targets = _loader(dataset).next_batch()
    assert inputs.shape == targets.shape == (8, 16)
    assert inputs.dtype == targets.dtype == torch.int64
    assert torch.equal(inputs[:, 1:], targets[:, :-1])
    row = bytes(inputs[0].tolist())
    assert row in bytes(np.asarray(dataset.tokens))


def test_dp_ranks_concatenate_to_the_single_process_batch(dataset: TokenDataset) -> None:
    full = _loader(dataset).batch_at(5)
    shards = [_loader(dataset, dp_rank=r, dp_size=2).batch_at(5) for r in range(2)]
    assert shards[0][0].shape == (4, 16)
    assert torch.equal(torch.cat([s[0] for s in shards]), full[0])
    assert torch.equal(torch.cat([s[1] for s in shards]), full[1])


def test_resume_continues_with_the_uninterrupted_batches(dataset: TokenDataset) -> None:
    uninterrupted = _loader(dataset)
    expected = [uninterrupted.next_batch()[0] for _ in range(5)]
    before = _loader(dataset)
    before.next_batch(), before.next_batch()
    resumed = _loader(dataset)
    resumed.load_state_dict(before.state_dict())
    assert resumed.position == 2
    for want in expected[2:]:
        assert torch.equal(resumed.next_batch()[0], want)


def test_resume_refuses_a_different_batch_recipe(dataset: TokenDataset) -> None:
    state = _loader(dataset).state_dict()
    with pytest.raises(ValueError, match=r"seq_len=16 .* seq_len=32"):
        _loader(dataset, seq_len=32).load_state_dict(state)


def _reprepared(dataset: TokenDataset, text: str) -> TokenDataset:
    """The same prefix prepared again from other text."""
    source = dataset.info.bin_path.parent / "other.txt"
    source.write_text(text)
    return load_tokens(prepare(source, dataset.info.bin_path).bin_path)


def test_resume_refuses_a_token_file_prepared_again_with_other_text(dataset: TokenDataset) -> None:
    state = _loader(dataset).state_dict()
    same_length = _reprepared(dataset, "x" * len(dataset))
    with pytest.raises(ValueError, match=r"now holds \d+ \(sha256 .*the token file changed since"):
        _loader(same_length).load_state_dict(state)


def test_resume_refuses_a_token_file_of_another_length(dataset: TokenDataset) -> None:
    state = _loader(dataset).state_dict()
    longer = _reprepared(dataset, "y" * (len(dataset) + 100))
    with pytest.raises(ValueError, match=rf"trained on {len(dataset)} tokens"):
        _loader(longer).load_state_dict(state)


def test_a_loader_state_from_before_the_token_digest_still_resumes(dataset: TokenDataset) -> None:
    state = _loader(dataset).state_dict()
    del state["tokens"], state["sha256"]
    _loader(dataset).load_state_dict(state)


def test_prepare_rejects_empty_folder(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no files ending in .py .txt .md .rst") as error:
        prepare(tmp_path / "empty", tmp_path / "out")
    assert "`meshpipe data prepare` reads only files with those suffixes" in str(error.value)
    assert "pass one file of any name as SOURCE" in str(error.value)


def test_prepare_rejects_a_zero_cap_naming_the_flag(tmp_path: Path) -> None:
    src = _write(tmp_path / "src", {"a.txt": "abc"})
    with pytest.raises(ValueError, match=r"max_bytes=0 \(--max-bytes\) must be >= 1; leave it out"):
        prepare(src, tmp_path / "out", max_bytes=0)


def test_prepare_rejects_nonexistent_source(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        prepare(tmp_path / "nope", tmp_path / "out")


def test_load_rejects_missing_files_with_the_command_that_makes_them(tmp_path: Path) -> None:
    prefix = tmp_path / "nothing"
    with pytest.raises(ValueError, match=r"token file .*nothing\.bin' does not exist") as error:
        load_tokens(f"{prefix}.bin")
    assert f"`meshpipe data prepare SOURCE --out {prefix}`" in str(error.value)
    assert "engine.prepare()" in str(error.value)


def test_load_rejects_a_bin_without_its_header(tmp_path: Path) -> None:
    (tmp_path / "raw.bin").write_bytes(b"abc")
    with pytest.raises(ValueError, match=r"header .*raw\.json' does not exist next to") as error:
        load_tokens(tmp_path / "raw.bin")
    assert f"`meshpipe data prepare SOURCE --out {tmp_path / 'raw'}`" in str(error.value)


@pytest.mark.parametrize("name", ["small.txt", "corpus"])
def test_load_of_a_raw_text_file_says_to_prepare_it(tmp_path: Path, name: str) -> None:
    """`meshpipe train --data small.txt`: the text, not the token file made from it."""
    text = _write(tmp_path, {name: "hello world\n"}) / name
    with pytest.raises(ValueError, match="is a file, not a token file") as error:
        load_tokens(text)
    prefix = text.with_suffix("")
    assert f"`meshpipe data prepare {text} --out {prefix}`" in str(error.value)
    assert f"--data {prefix}" in str(error.value)
    prepare(text, prefix)  # the advice works
    assert decode(load_tokens(prefix).tokens) == "hello world\n"


def test_load_of_a_folder_says_to_prepare_it(tmp_path: Path) -> None:
    src = _write(tmp_path / "texts", {"a.txt": "abc"})
    with pytest.raises(ValueError, match="is a folder, not a token file") as error:
        load_tokens(src)
    assert f"`meshpipe data prepare {src} --out {src}`" in str(error.value)


def test_the_cli_names_the_prepare_command_for_a_raw_text_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text = _write(tmp_path, {"small.txt": "hello world\n" * 20}) / "small.txt"
    argv = ["train", "--model", "gpt-tiny", "--steps", "1", "--global-batch", "4"]
    with pytest.raises(SystemExit):
        main([*argv, "--micro-batches", "2", "--seq-len", "32", "--data", str(text)])
    err = capsys.readouterr().err
    assert f"meshpipe data prepare {text} --out {tmp_path / 'small'}" in err
    assert f"--data {tmp_path / 'small'}" in err


def test_load_rejects_corrupt_header(tmp_path: Path) -> None:
    info = prepare(_write(tmp_path / "src", {"a.txt": "abc"}), tmp_path / "out")
    info.json_path.write_text("{not json")
    with pytest.raises(ValueError, match="unreadable"):
        load_tokens(info.bin_path)


def test_load_rejects_foreign_header(tmp_path: Path) -> None:
    info = prepare(_write(tmp_path / "src", {"a.txt": "abc"}), tmp_path / "out")
    info.json_path.write_text('{"format": "other"}')
    with pytest.raises(ValueError, match="not a 'meshpipe-tokens' header"):
        load_tokens(info.bin_path)


def test_load_rejects_size_mismatch(tmp_path: Path) -> None:
    info = prepare(_write(tmp_path / "src", {"a.txt": "abcdef"}), tmp_path / "out")
    info.bin_path.write_bytes(b"abc")
    with pytest.raises(ValueError, match="has 3 bytes but its header promises 6") as error:
        load_tokens(info.bin_path)
    assert f"`meshpipe data prepare SOURCE --out {tmp_path / 'out'}`" in str(error.value)


@pytest.mark.parametrize("umask", [0o022, 0o027], ids=["umask022", "umask027"])
def test_prepared_files_get_the_mode_open_gives(tmp_path: Path, umask: int) -> None:
    """Not the owner-only 0600 of a temp file: token files are read by other users' runs."""
    old = os.umask(umask)
    try:
        info = prepare(_write(tmp_path / "src", {"a.txt": "abc"}), tmp_path / "out" / "tokens")
    finally:
        os.umask(old)
    for path in (info.bin_path, info.json_path):
        assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask, path
    assert stat.S_IMODE((tmp_path / "out").stat().st_mode) == 0o777 & ~umask


def test_default_corpus_rebuilds_an_invalid_cache(tmp_path: Path) -> None:
    info = default_corpus(tmp_path, max_bytes=1000)
    info.bin_path.write_bytes(b"x")
    assert default_corpus(tmp_path, max_bytes=1000) == info
    assert info.bin_path.stat().st_size == 1000


def test_loader_rejects_global_batch_not_divisible_by_dp(dataset: TokenDataset) -> None:
    with pytest.raises(ValueError, match="global_batch=6 is not divisible by dp_size=4"):
        _loader(dataset, global_batch=6, dp_size=4)


def test_loader_rejects_dp_rank_out_of_range(dataset: TokenDataset) -> None:
    with pytest.raises(ValueError, match=r"dp_rank=2 is out of range; use 0\.\.1"):
        _loader(dataset, dp_rank=2, dp_size=2)


def test_loader_rejects_nonpositive_seq_len(dataset: TokenDataset) -> None:
    with pytest.raises(ValueError, match="seq_len=0 must be a positive int"):
        _loader(dataset, seq_len=0)


def test_loader_rejects_too_short_dataset(tmp_path: Path) -> None:
    info = prepare(_write(tmp_path / "src", {"a.txt": "0123456789"}), tmp_path / "out")
    with pytest.raises(ValueError, match="too short for seq_len=10"):
        BatchLoader(load_tokens(info.bin_path), seq_len=10, global_batch=1, seed=0)


def test_loader_accepts_exactly_seq_len_plus_one_tokens(tmp_path: Path) -> None:
    info = prepare(_write(tmp_path / "src", {"a.txt": "0123456789"}), tmp_path / "out")
    loader = BatchLoader(load_tokens(info.bin_path), seq_len=9, global_batch=2, seed=0)
    inputs, targets = loader.next_batch()
    assert decode(inputs[0]) == "012345678" and decode(targets[1]) == "123456789"
