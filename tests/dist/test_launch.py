"""`meshpipe train` runs the same under its own local launcher, torchrun-style and
deepspeed-style environments, and in one process."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

import engine.training.workers
from engine.cli.main import main
from engine.training.config import TrainConfig
from engine.training.data import prepare
from engine.training.loop import train
from tests.dist.harness import free_port, run_ranks

ARGS = ["--model", "llama-tiny", "--steps", "3", "--global-batch", "8", "--micro-batches", "2",
        "--seq-len", "32", "--threads", "1", "--no-progress"]


@pytest.fixture(scope="module")
def tokens(tmp_path_factory: pytest.TempPathFactory) -> str:
    folder = tmp_path_factory.mktemp("corpus")
    text = "pipelines move activations forward and gradients back\n"
    (folder / "text.txt").write_text(text * 300)
    return str(prepare(folder / "text.txt", folder / "tokens").bin_path)


def _single_process_losses(data: str) -> tuple[float, ...]:
    config = TrainConfig.of(model="llama-tiny", steps=3, global_batch=8, micro_batches=2,
                         seq_len=32, threads=1, data=data)
    return train(config, progress=False).losses


def _final_loss(text: str) -> float:
    match = re.search(r"final loss (\d+\.\d+)", text)
    assert match, text
    return float(match.group(1))


def test_plain_start_with_pp2_launches_its_own_ranks(
    tokens: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["train", *ARGS, "--data", tokens, "--pp", "2"]) == 0
    out = capsys.readouterr().out
    assert _final_loss(out) == pytest.approx(_single_process_losses(tokens)[-1], abs=1e-4)
    assert "bubble" in out


def _deepspeed_style_rank(rank: int, world_size: int, data: str) -> int:
    """What the deepspeed launcher does: the env of torchrun plus --local_rank=N, put before
    the subcommand."""
    return main([f"--local_rank={rank}", "train", *ARGS, "--data", data, "--pp", "2"])


def test_deepspeed_launcher_arguments_are_accepted(tokens: str) -> None:
    assert run_ranks(_deepspeed_style_rank, 2, tokens) == [0, 0]


def test_the_deepspeed_launcher_runs_meshpipe_train_as_one_process_would(tokens: str) -> None:
    pytest.importorskip("deepspeed", reason="deepspeed is not installed (pip install .[deepspeed])")
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root), "DS_ACCELERATOR": "cpu"}
    argv = ["deepspeed", "--num_gpus", "2", "--master_port", str(free_port()), "--module",
            "engine.cli", "train", *ARGS, "--data", tokens, "--pp", "2"]  # fmt: skip
    run = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300, cwd=root)
    assert run.returncode == 0, run.stdout + run.stderr
    assert _final_loss(run.stdout) == pytest.approx(_single_process_losses(tokens)[-1], abs=1e-4)


def test_launcher_world_size_must_match_pp_times_dp(
    tokens: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit):
        main(["train", *ARGS, "--data", tokens, "--pp", "2", "--dp", "2"])
    assert "= 4 ranks, but the launcher started 2" in capsys.readouterr().err


def test_pp_dp_losses_equal_single_process_losses_exactly(tokens: str) -> None:
    results = run_ranks(_train_pp2, 2, tokens)
    assert results[0] == results[1] == _single_process_losses(tokens)


def _train_pp2(rank: int, world_size: int, data: str) -> tuple[float, ...]:
    config = TrainConfig.of(model="llama-tiny", steps=3, global_batch=8, micro_batches=2,
                         seq_len=32, threads=1, data=data, pp=2)
    return train(config, progress=False).losses


def test_metrics_are_written_by_rank_zero_only(tokens: str, tmp_path: Path) -> None:
    metrics = tmp_path / "m.jsonl"
    flags = ["--data", tokens, "--pp", "2", "--metrics-file", str(metrics)]
    assert main(["train", *ARGS, *flags]) == 0
    lines = metrics.read_text().splitlines()
    assert len(lines) == 3 and all('"bubble"' in line for line in lines)


def test_a_failing_rank_is_reported_in_one_line_with_its_own_error(
    tokens: str, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "step-00000001").mkdir()
    (tmp_path / "step-00000001" / "trainer.json").write_text("{not json")
    (tmp_path / "latest").write_text("step-00000001\n")
    argv = ["train", *ARGS, "--data", tokens, "--pp", "2", "--checkpoint-dir", str(tmp_path)]
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--resume"])
    err = capfd.readouterr().err
    assert exit_info.value.code == 2  # bad input, as in one process
    failed = r"^meshpipe: error: rank \d failed: CheckpointError: .*step-00000001"
    assert re.search(failed, err, re.M)
    assert "Traceback" not in err


def test_ctrl_c_stops_every_rank_and_names_the_checkpoint_to_resume_from(
    tokens: str, tmp_path: Path
) -> None:
    argv = [sys.executable, "-m", "engine.cli", "train", *ARGS, "--data", tokens, "--pp", "2",
            "--checkpoint-dir", str(tmp_path), "--save-every", "1"]  # fmt: skip
    argv[argv.index("--steps") + 1] = "100000"
    # A terminal's Ctrl-C signals its whole process group: here, a session of its own.
    run = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + 120
    while not (tmp_path / "latest").exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    os.killpg(run.pid, signal.SIGINT)
    _, err = run.communicate(timeout=60)
    assert run.returncode == 130, err
    assert re.search(r"^meshpipe: interrupted; the newest checkpoint is .*step-\d{8}: the same "
                     r"command with --resume goes on from it$", err, re.M), err  # fmt: skip
    assert "Traceback" not in err and "death signal" not in err, err


def test_ctrl_c_in_one_process_says_no_checkpoint_was_written(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def interrupted(*_: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(engine.training.workers, "train_worker", interrupted)
    with pytest.raises(SystemExit) as exit_info:
        main(["train", *ARGS])
    assert exit_info.value.code == 130
    assert "interrupted; no checkpoint was written" in capsys.readouterr().err


def test_a_schedule_file_trains_as_the_schedule_it_was_saved_from(
    tokens: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "zb.csv"
    assert main(["schedule", "--schedule", "zb_h1", "--pp", "2", "--micro-batches", "2",
                 "--out", str(path)]) == 0  # fmt: skip
    runs = {}
    for schedule in ("zb_h1", str(path)):
        metrics = tmp_path / f"{len(runs)}.jsonl"
        argv = ["train", *ARGS, "--data", tokens, "--pp", "2", "--schedule", schedule]
        assert main([*argv, "--metrics-file", str(metrics)]) == 0
        runs[schedule] = [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]
    assert runs[str(path)] == runs["zb_h1"]


@pytest.mark.parametrize(
    "flags", [["--schedule", "zb_v"], ["--schedule", "looped_bfs", "--placement", "v"]]
)
def test_v_placed_stages_train_from_the_command_line_as_one_process(
    tokens: str, tmp_path: Path, flags: list[str]
) -> None:
    """Two stages per rank placed as a V (rank 0 holds the first and the last): llama-tiny
    has no weight tied across stages, so every loss equals the single process's."""
    metrics = tmp_path / "v.jsonl"
    argv = ["train", *ARGS, "--data", tokens, "--pp", "2", "--stages-per-rank", "2", *flags]
    assert main([*argv, "--metrics-file", str(metrics)]) == 0
    losses = [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]
    assert tuple(losses) == _single_process_losses(tokens)


def test_a_finished_local_run_leaves_no_rank_folders_behind(
    tokens: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert main(["train", *ARGS, "--data", tokens, "--pp", "2"]) == 0
    rank_folders = ("torchelastic_", "meshpipe-ranks-")  # the agent's default, and ours
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(rank_folders)] == []


def test_partition_memory_under_tp_splits_before_the_ranks_meet(
    tokens: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--partition memory` traces tp stages with the engine's DTensor plans on a fake world of
    their own, which a rank already in its process group could not join: each rank splits
    the model before its group exists, and trains as one process would (to tp's rounding)."""
    argv = ["train", *ARGS, "--data", tokens, "--pp", "2", "--tp", "2"]
    assert main([*argv, "--partition", "memory", "--device-memory", "1GB"]) == 0
    expected = _single_process_losses(tokens)[-1]
    assert _final_loss(capsys.readouterr().out) == pytest.approx(expected, abs=1e-4)
