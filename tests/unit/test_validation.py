"""Specifications of validation in `meshpipe train`: its records, its plot, its refusals."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from engine.training.config import TrainConfig
from engine.training.loop import train
from engine.training.metrics import plot_metrics, read_records
from engine.training.preflight import preflight

RUN = {"model": "gpt-tiny", "global_batch": 2, "micro_batches": 1, "seq_len": 16}


def _token_file(path: Path, eos_id: int | None) -> str:
    """60 documents of 3 to 11 tokens, each ending with token 0."""
    lengths = np.random.default_rng(0).integers(3, 12, size=60)
    tokens = [t for k, n in enumerate(lengths) for t in [k + 1] * (n - 1) + [0]]
    path.with_suffix(".bin").write_bytes(np.asarray(tokens, dtype=np.uint8).tobytes())
    header = {"format": "meshpipe-tokens", "version": 1, "dtype": "uint8", "vocab_size": 256}
    header |= {"num_tokens": len(tokens)} | ({} if eos_id is None else {"eos_id": eos_id})
    path.with_suffix(".json").write_text(json.dumps(header))
    return str(path)


def test_a_run_records_its_validation_loss_every_n_steps_and_after_the_last(
    tmp_path: Path,
) -> None:
    metrics = tmp_path / "m.jsonl"
    config = TrainConfig.of(
        **RUN,
        steps=3,
        data=_token_file(tmp_path / "docs", eos_id=0),
        val_fraction=0.2,
        eval_every=2,
        eval_batches=2,
        pack_documents=True,
        metrics_file=str(metrics),
    )
    result = train(config, progress=False)
    evals = [r for r in read_records(metrics) if r.get("kind") == "eval"]
    assert [r["step"] for r in evals] == [1, 2]
    assert all(math.isfinite(r["val_loss"]) for r in evals)
    assert result.val_loss == evals[-1]["val_loss"]
    assert len([r for r in read_records(metrics) if "kind" not in r]) == 3


def test_the_plot_draws_a_metrics_file_with_validation_records(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    metrics = tmp_path / "m.jsonl"
    records = [
        {"step": 0, "loss": 5.0, "lr": 1e-3},
        {"step": 1, "loss": 4.0, "lr": 1e-3},
        {"kind": "eval", "step": 1, "val_loss": 4.5},
    ]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert plot_metrics(metrics).stat().st_size > 0


def test_eval_every_without_validation_data_is_refused_naming_the_flags() -> None:
    with pytest.raises(ValueError, match="add --val-data PATH or --val-fraction F"):
        TrainConfig.of(eval_every=10)


def test_packing_a_file_without_eos_is_refused_before_any_rank_starts(tmp_path: Path) -> None:
    config = TrainConfig.of(
        **RUN, steps=1, data=_token_file(tmp_path / "bytes", eos_id=None), pack_documents=True
    )
    with pytest.raises(ValueError, match="--pack-documents needs document boundaries"):
        preflight(config)


def test_two_sources_of_validation_data_are_refused() -> None:
    with pytest.raises(ValueError, match="--val-data and --val-fraction both name"):
        TrainConfig.of(val_data="v.bin", val_fraction=0.1)


def test_packed_documents_with_compile_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="--pack-documents with --compile"):
        TrainConfig.of(pack_documents=True, compile=True)
