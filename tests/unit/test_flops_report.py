"""The FLOPs report of a step (--flops-profile-step, DeepSpeed's flops_profiler): FLOPs counted
per layer and stage as worked out by hand for gpt-tiny, recomputation counted exactly, and the
report printed and written by a run."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from engine.cli.main import main
from engine.training.config import TrainConfig
from engine.training.flops_report import (
    FlopsReport,
    flops_report,
    format_flops_report,
    recomputed_share,
)
from engine.training.loop import train
from partitioners import Partition

# gpt-tiny (d_model 64, 4 heads, ffn 256, vocab 256) on micro-batches of 2 x 32 tokens (64):
EMBEDDING = 64 * 64  # one add of wte and wpe per token and feature
BLOCK = 2 * 64 * (4 * 64 * 64 + 2 * 64 * 256) + 2 * 2 * 32 * 32 * 64  # GEMMs + causal attention
FINAL_NORM = 5 * 64 * 64
HEAD = 2 * 64 * 64 * 256
STAGE_0 = EMBEDDING + 2 * BLOCK  # layers 0-2 of (0, 3, 7)
STAGE_1 = 2 * BLOCK + FINAL_NORM + HEAD  # layers 3-6


def _report(seconds: float = 1.0, **settings: object) -> FlopsReport:
    config = TrainConfig.of(pp=2, global_batch=8, micro_batches=4, seq_len=32, **settings)
    partition = Partition.from_boundaries((0, 3, 7))
    specs = config.model.specs()
    return flops_report(config, specs, partition, (0, 1), step=1, seconds=seconds)


def test_hand_counted_forward_flops_per_micro_batch() -> None:
    assert (BLOCK, STAGE_0, STAGE_1) == (6_553_600, 13_111_296, 15_224_832)
    report = _report()
    assert [s.forward_flops for s in report.stages] == [STAGE_0, STAGE_1]
    assert [layer.forward_flops for layer in report.stages[1].layers] == [
        BLOCK,
        BLOCK,
        FINAL_NORM,
        HEAD,
    ]


def test_a_step_without_recompute_costs_three_forwards_per_micro_batch() -> None:
    report = _report()
    assert [s.step_flops for s in report.stages] == [4 * 3 * STAGE_0, 4 * 3 * STAGE_1]
    assert report.step_flops == 340_033_536
    assert recomputed_share(report.stages) == 0.0


def test_full_recompute_adds_one_forward_of_every_layer() -> None:
    report = _report(recompute="full")
    assert [s.step_flops for s in report.stages] == [4 * 4 * STAGE_0, 4 * 4 * STAGE_1]
    assert report.step_flops == 453_378_048
    assert recomputed_share(report.stages) == 1.0


def test_recompute_of_one_stage_adds_only_that_stages_forward() -> None:
    report = _report(recompute="every:2", recompute_stages="1")
    assert [s.recomputed_flops for s in report.stages] == [0, STAGE_1]
    assert report.step_flops == 4 * 3 * (STAGE_0 + STAGE_1) + 4 * STAGE_1


def test_replicas_multiply_the_mesh_flops_and_tp_divides_each_ranks() -> None:
    config = TrainConfig.of(pp=2, dp=2, tp=2, global_batch=16, micro_batches=4, seq_len=32)
    partition = Partition.from_boundaries((0, 3, 7))
    report = flops_report(config, config.model.specs(), partition, (0, 1), step=1, seconds=2.0)
    assert report.step_flops == 2 * 4 * 3 * (STAGE_0 + STAGE_1)
    assert report.rank_tflops(0) == 4 * 3 * STAGE_0 / 2 / 2.0 / 1e12
    assert report.mesh_tflops == report.step_flops / 2.0 / 1e12


def test_mfu_is_the_mesh_rate_over_every_ranks_peak() -> None:
    report = _report(seconds=0.5, flops_profile_step=1, device_peak_tflops=1.0)
    assert report.mfu == pytest.approx(340_033_536 / 0.5 / 1e12 / 2)
    assert "MFU 0.0% of 1 TFLOP/s per rank" in format_flops_report(report)


def test_without_a_peak_the_report_says_how_to_get_mfu() -> None:
    report = _report()
    assert report.mfu is None
    assert "MFU: give --device-peak-tflops X" in format_flops_report(report)


def test_the_text_has_a_row_per_stage_and_layer_and_the_total() -> None:
    text = format_flops_report(_report(recompute="full"))
    stage_1 = r"^\s+1\s+1 3-6\s+116,480\s+15,224,832\s+15,224,832\s+243,597,312$"
    assert re.search(stage_1, text, re.M)
    assert re.search(r"^\s+6 lm_head\s+16,384\s+2,097,152\s+2,097,152$", text, re.M)
    assert "over the mesh (x dp 1): 453,378,048" in text


def test_a_run_prints_and_writes_the_report_of_the_step_it_names(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "reports" / "flops.txt"
    argv = ["train", "--steps", "2", "--global-batch", "4", "--micro-batches", "2",
            "--seq-len", "32", "--no-progress", "--flops-profile-step", "2",
            "--flops-profile-file", str(out)]  # fmt: skip
    assert main(argv) == 0
    text = out.read_text(encoding="utf-8")
    assert text.startswith("FLOPs report of step 2: 2 micro-batches of 2 x 32 tokens")
    assert f"over the mesh (x dp 1): {2 * 3 * (STAGE_0 + STAGE_1):,}" in text
    assert text.strip() in capsys.readouterr().err


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"flops_profile_step": 3}, "--flops-profile-step 3 is after the run's last step \\(2\\)"),
        ({"flops_profile_file": "f.txt"}, "--flops-profile-file only applies to the FLOPs report"),
        ({"device_peak_tflops": 989.0}, "--device-peak-tflops only applies to the FLOPs report"),
        ({"flops_profile_step": -1}, "flops_profile_step=-1 must be >= 0"),
    ],
)
def test_report_settings_that_cannot_apply_are_refused_by_flag(
    settings: dict[str, object], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        TrainConfig.of(steps=2, **settings)


def test_an_unwritable_report_file_fails_before_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "file").write_text("")
    argv = ["train", "--steps", "1", "--no-progress", "--flops-profile-step", "1",
            "--flops-profile-file", str(tmp_path / "file" / "flops.txt")]  # fmt: skip
    with pytest.raises(SystemExit):
        main(argv)
    assert "--flops-profile-file" in capsys.readouterr().err


def test_a_resumed_run_past_the_profiled_step_says_there_is_no_report(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    settings = {"global_batch": 4, "micro_batches": 2, "seq_len": 32, "lr_schedule": "constant"}
    train(TrainConfig.of(steps=2, checkpoint_dir=str(tmp_path), **settings), progress=False)
    again = TrainConfig.of(
        steps=3, checkpoint_dir=str(tmp_path), resume=True, flops_profile_step=1, **settings
    )
    train(again, progress=False)
    err = capsys.readouterr().err
    assert "no FLOPs report: step 1 ran before the resumed step 3" in err
    assert "FLOPs report of step" not in err
