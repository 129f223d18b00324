"""The training loop with checkpoints in one process: save, resume exactly, start from weights."""

from __future__ import annotations

import json
import re
import shutil
import socket
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from engine.checkpoint.owner import OWNER_FILE, FolderLock, Owner
from engine.cli.main import build_parser, main
from engine.runtime.lr_schedules import lr_factor
from engine.training.batches import BatchLoader
from engine.training.config import TrainConfig
from engine.training.data import load_tokens, prepare
from engine.training.generate import load_model
from engine.training.loop import TrainResult, train
from engine.training.resume_check import check_resumable
from models import lm_loss
from tests.unit.cli_error import cli_error

torch.set_num_threads(1)

RUN = {
    "model": "llama-tiny",
    "steps": 6,
    "global_batch": 4,
    "micro_batches": 2,
    "seq_len": 32,
    "warmup_steps": 2,
    "lr": 3e-3,
    "threads": 1,
}


@pytest.fixture(scope="module")
def tokens(tmp_path_factory: pytest.TempPathFactory) -> str:
    folder = tmp_path_factory.mktemp("corpus")
    (folder / "text.txt").write_text("checkpoints keep long runs alive across failures\n" * 200)
    return str(prepare(folder / "text.txt", folder / "tokens").bin_path)


def _copy_step(source: Path, step: int, dest: Path) -> None:
    """What a run interrupted after `step` leaves behind: that checkpoint, named latest."""
    name = f"step-{step:08d}"
    shutil.copytree(source / name, dest / name)
    (dest / "latest").write_text(name + "\n")


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for shard in sorted(directory.glob("*.safetensors")):
        out.update({f"{shard.name}:{k}": v for k, v in load_file(shard).items()})
    return out


def _records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _interrupted(run: dict[str, Any], root: Path, at: int) -> dict[str, Any]:
    """`run` uninterrupted, and resumed from its step-`at` checkpoint as a run interrupted
    after that step would be (that checkpoint and the metrics so far left behind)."""
    full = train(
        TrainConfig.of(
            **run, checkpoint_dir=str(root / "full"), metrics_file=str(root / "full.jsonl")
        ),
        progress=False,
    )
    _copy_step(root / "full", at, root / "resumed")
    shutil.copy(root / "full.jsonl", root / "resumed.jsonl")
    resumed = train(
        TrainConfig.of(
            **run,
            checkpoint_dir=str(root / "resumed"),
            resume=True,
            metrics_file=str(root / "resumed.jsonl"),
        ),
        progress=False,
    )
    return {"root": root, "full": full, "resumed": resumed}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, tokens: str) -> dict[str, Any]:
    """An uninterrupted run saving at step 3 and 6, and a run resumed from its step 3."""
    root = tmp_path_factory.mktemp("runs")
    return _interrupted({**RUN, "data": tokens, "save_every": 3}, root, 3)


def test_a_resumed_run_continues_with_the_same_losses(runs: dict[str, Any]) -> None:
    assert runs["resumed"].first_step == 3
    assert runs["resumed"].losses == runs["full"].losses[3:]


def test_a_resumed_run_ends_with_the_same_weights_and_optimizer_state(
    runs: dict[str, Any],
) -> None:
    full = _tensors(runs["root"] / "full" / "step-00000006")
    resumed = _tensors(runs["root"] / "resumed" / "step-00000006")
    assert full.keys() == resumed.keys()
    assert all(torch.equal(full[k], resumed[k]) for k in full)


def test_a_resumed_run_resumes_the_learning_rate_schedule(runs: dict[str, Any]) -> None:
    full = _records(runs["root"] / "full.jsonl")
    resumed = _records(runs["root"] / "resumed.jsonl")
    assert [r["lr"] for r in resumed] == [r["lr"] for r in full]


def test_a_resumed_run_keeps_the_earlier_metrics_once(runs: dict[str, Any]) -> None:
    resumed = _records(runs["root"] / "resumed.jsonl")
    assert [r["step"] for r in resumed] == [0, 1, 2, 3, 4, 5]
    assert [r["loss"] for r in resumed] == list(runs["full"].losses)


def test_a_deepspeed_cpu_adam_run_resumes_with_the_same_losses(tmp_path: Path, tokens: str) -> None:
    pytest.importorskip("deepspeed", reason="deepspeed is not installed")
    run = {**RUN, "steps": 4, "save_every": 2, "optimizer_impl": "deepspeed_cpu", "data": tokens}
    result = _interrupted(run, tmp_path, 2)
    assert result["resumed"].losses == result["full"].losses[2:]


@pytest.fixture(scope="module")
def fp16_runs(tmp_path_factory: pytest.TempPathFactory, tokens: str) -> dict[str, Any]:
    """fp16 with a learning rate high enough that step 1 overflows and halves the loss scale
    before the step-3 checkpoint; an uninterrupted run and one resumed from step 3."""
    root = tmp_path_factory.mktemp("fp16")
    run = {
        **RUN,
        "model": "gpt-tiny",
        "precision": "fp16",
        "lr": 0.5,
        "warmup_steps": 0,
        "save_every": 3,
        "data": tokens,
    }
    return _interrupted(run, root, 3)


def _trainer(directory: Path) -> dict[str, Any]:
    return json.loads((directory / "trainer.json").read_text())


def test_an_fp16_run_resumes_with_the_same_losses(fp16_runs: dict[str, Any]) -> None:
    assert any(r["skipped"] for r in _records(fp16_runs["root"] / "full.jsonl")[:3])
    assert fp16_runs["resumed"].losses == fp16_runs["full"].losses[3:]


def test_an_fp16_resume_keeps_the_loss_scale_and_the_skipped_step_count(
    fp16_runs: dict[str, Any],
) -> None:
    full = _trainer(fp16_runs["root"] / "full" / "step-00000006")
    resumed = _trainer(fp16_runs["root"] / "resumed" / "step-00000006")
    assert full["loss_scale"]["scale"] < 2.0**16
    assert (resumed["loss_scale"], resumed["skipped_steps"]) == (
        full["loss_scale"],
        full["skipped_steps"],
    )


def test_resume_without_a_checkpoint_starts_from_step_zero(tmp_path: Path, tokens: str) -> None:
    config = TrainConfig.of(
        **{**RUN, "steps": 2}, data=tokens, checkpoint_dir=str(tmp_path), resume=True
    )
    assert train(config, progress=False).first_step == 0
    assert (tmp_path / "latest").read_text() == "step-00000002\n"


def test_resuming_a_finished_run_runs_no_step(runs: dict[str, Any], tokens: str) -> None:
    config = TrainConfig.of(
        **RUN, data=tokens, checkpoint_dir=str(runs["root"] / "full"), resume=True
    )
    result = train(config, progress=False)
    assert (result.first_step, result.losses) == (6, ())


def test_init_from_starts_from_the_checkpoint_weights(runs: dict[str, Any], tokens: str) -> None:
    source = runs["root"] / "full" / "step-00000003"
    config = TrainConfig.of(**{**RUN, "steps": 1}, data=tokens, init_from=str(source))
    first_loss = train(config, progress=False).losses[0]
    model, _ = load_model(source)
    loader = BatchLoader(load_tokens(tokens), seq_len=32, global_batch=4, seed=0)
    inputs, targets = loader.batch_at(0)
    with torch.no_grad():
        halves = [
            lm_loss(model(x), y) for x, y in zip(inputs.split(2), targets.split(2), strict=True)
        ]
    assert first_loss == pytest.approx(float(torch.stack(halves).mean()), abs=1e-6)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"resume": True}, "--resume needs a --checkpoint-dir"),
        ({"save_every": 5}, "--save-every needs a --checkpoint-dir"),
        ({"keep": 2}, "--keep needs a --checkpoint-dir"),
        ({"checkpoint_dir": "d", "resume_fallback": True}, "only applies with --resume"),
        (
            {"checkpoint_dir": "d", "resume_with_new_hparams": True},
            "--resume-with-new-hparams only applies with --resume",
        ),
        ({"checkpoint_dir": "d", "max_restarts": 2}, "would start over from step 0"),
        ({"checkpoint_dir": "d", "save_every": -1}, "save_every=-1 must be >= 0"),
    ],
)
def test_checkpoint_options_are_checked_before_any_compute(
    fields: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        TrainConfig.of(**fields)


def test_checkpoint_flags_reach_the_config() -> None:
    args = build_parser().parse_args(
        [
            "train",
            "--checkpoint-dir",
            "ck",
            "--save-every",
            "2",
            "--keep",
            "3",
            "--resume",
            "--resume-fallback",
            "--resume-with-new-hparams",
            "--max-restarts",
            "1",
            "--init-from",
            "hf",
        ]
    )
    assert (args.checkpoint_dir, args.save_every, args.keep) == ("ck", 2, 3)
    assert (args.resume, args.resume_fallback, args.max_restarts, args.init_from) == (
        True,
        True,
        1,
        "hf",
    )
    assert args.resume_with_new_hparams is True
    assert build_parser().parse_args(["train"]).resume is False


def _run_argv(tokens: str, root: Path, **changes: Any) -> list[str]:
    """`meshpipe train` arguments of the `runs` job (RUN, with `changes`) saving to `root`."""
    argv = ["train", "--data", tokens, "--checkpoint-dir", str(root)]
    for name, value in {**RUN, **changes}.items():
        argv += [f"--{name.replace('_', '-')}", str(value)]
    return argv


def test_cli_resume_says_where_it_resumed_from(
    runs: dict[str, Any], tokens: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _copy_step(runs["root"] / "full", 3, tmp_path)
    argv = [*_run_argv(tokens, tmp_path), "--resume", "--no-progress"]
    assert main(argv) == 0
    assert "resumed from step 3" in capsys.readouterr().err


def _latest_trainer_edited(runs: dict[str, Any], root: Path) -> None:
    """Steps 3 and 6 of the `runs` job, step 6's lr schedule moved on by one step by hand."""
    _copy_step(runs["root"] / "full", 3, root)
    _copy_step(runs["root"] / "full", 6, root)
    trainer = root / "step-00000006" / "trainer.json"
    text = trainer.read_text()
    assert '"last_epoch": 6' in text
    trainer.write_text(text.replace('"last_epoch": 6', '"last_epoch": 7'))


def test_cli_resume_from_an_edited_trainer_json_fails_naming_it(
    runs: dict[str, Any], tokens: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _latest_trainer_edited(runs, tmp_path)
    argv = [*_run_argv(tokens, tmp_path, save_every=3), "--resume", "--no-progress"]
    code, err = cli_error(argv, capsys)
    assert code != 0
    assert re.search(r"step-00000006/trainer\.json: sha256 .* does not match", err), err
    assert "step-00000003: pass --resume-fallback" in err


def test_cli_resume_fallback_skips_an_edited_trainer_json_and_ends_bit_for_bit(
    runs: dict[str, Any], tokens: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _latest_trainer_edited(runs, tmp_path)
    argv = [*_run_argv(tokens, tmp_path, save_every=3), "--resume", "--resume-fallback"]
    assert main([*argv, "--no-progress"]) == 0
    assert "resumed from step 3" in capsys.readouterr().err
    full = _tensors(runs["root"] / "full" / "step-00000006")
    again = _tensors(tmp_path / "step-00000006")
    assert full.keys() == again.keys()
    assert all(torch.equal(full[k], again[k]) for k in full)


def test_cli_resume_from_a_checkpoint_without_a_manifest_says_so_and_resumes(
    runs: dict[str, Any], tokens: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _copy_step(runs["root"] / "full", 3, tmp_path)
    (tmp_path / "step-00000003" / "manifest.json").unlink()
    argv = [*_run_argv(tokens, tmp_path), "--resume", "--no-progress"]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "step-00000003 has no manifest.json (saved by an earlier meshpipe)" in err
    assert "resumed from step 3" in err


def test_a_run_into_a_folder_another_run_holds_is_refused_naming_it(
    tokens: str, tmp_path: Path
) -> None:
    other = Owner(run="run-a", host=socket.gethostname(), pid=111, since="2026-11-24T10:00:00Z")
    held = FolderLock(tmp_path, other)
    held.acquire()
    config = TrainConfig.of(**{**RUN, "steps": 1}, data=tokens, checkpoint_dir=str(tmp_path))
    with pytest.raises(ValueError, match=r"in use by run run-a \(pid 111 on host"):
        train(config, progress=False)
    held.release()
    assert not list(tmp_path.glob("step-*"))


def test_a_run_releases_its_folder_when_it_ends(tokens: str, tmp_path: Path) -> None:
    config = TrainConfig.of(**{**RUN, "steps": 1}, data=tokens, checkpoint_dir=str(tmp_path))
    train(config, progress=False)
    assert (tmp_path / OWNER_FILE).read_text() == ""


def _resume_changed(runs: dict[str, Any], tokens: str, root: Path, **changes: Any) -> TrainResult:
    """The `runs` job resumed from its step-3 checkpoint with `changes` to its settings."""
    _copy_step(runs["root"] / "full", 3, root)
    config = TrainConfig.of(
        **{**RUN, "save_every": 3, **changes},
        data=tokens,
        checkpoint_dir=str(root),
        resume=True,
        metrics_file=str(root / "metrics.jsonl"),
    )
    return train(config, progress=False)


def test_a_resume_with_other_hyperparameters_is_refused_naming_each_change(
    runs: dict[str, Any], tokens: str, tmp_path: Path
) -> None:
    expected = (
        r"step 3 was trained with other settings \(lr: 0\.003 → 0\.001; weight_decay: 0\.1 → "
        r"0\.0\): resume with the checkpoint's \(--lr 0\.003 --weight-decay 0\.1\), or add "
        r"--resume-with-new-hparams"
    )
    with pytest.raises(ValueError, match=expected):
        _resume_changed(runs, tokens, tmp_path, lr=1e-3, weight_decay=0.0)


def test_a_longer_run_is_refused_when_its_schedule_decays_to_the_last_step(
    runs: dict[str, Any], tokens: str, tmp_path: Path
) -> None:
    with pytest.raises(ValueError, match="steps: 6 → 8"):
        _resume_changed(runs, tokens, tmp_path, steps=8)


def test_the_refusal_spells_the_checkpoints_values_as_flags_a_shell_takes() -> None:
    kind = {"lr_schedule": "deepspeed:WarmupLR"}
    saved = TrainConfig.of(**kind, lr_schedule_args='{"warmup_num_steps": 5}').flat()
    flag = re.escape("""--lr-schedule-args '{"warmup_num_steps": 5}'""")
    with pytest.raises(ValueError, match=flag):
        check_resumable(saved, TrainConfig.of(**kind, lr_schedule_args="{}"), 3, "ck/step-3")


def test_a_longer_run_with_a_constant_schedule_is_the_same_run() -> None:
    saved = TrainConfig.of(lr_schedule="constant", steps=6).flat()
    assert check_resumable(saved, TrainConfig.of(lr_schedule="constant", steps=8), 6, "ck") == ""


def test_a_resume_may_change_the_layout(runs: dict[str, Any], tokens: str, tmp_path: Path) -> None:
    resumed = _resume_changed(runs, tokens, tmp_path, micro_batches=4, schedule="gpipe")
    assert resumed.first_step == 3
    assert resumed.losses == pytest.approx(runs["full"].losses[3:], rel=1e-5)


def test_resume_with_new_hparams_continues_with_them_from_the_resumed_step(
    runs: dict[str, Any], tokens: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    changes = {"lr": 1e-3, "weight_decay": 0.0, "resume_with_new_hparams": True}
    _resume_changed(runs, tokens, tmp_path, **changes)
    lrs = [r["lr"] for r in _records(tmp_path / "metrics.jsonl") if r["step"] >= 3]
    schedule = {"schedule": "cosine", "warmup_steps": 2, "total_steps": 6, "min_ratio": 0.1}
    assert lrs == [1e-3 * lr_factor(step, **schedule) for step in (3, 4, 5)]
    index = tmp_path / "step-00000006" / "optim.safetensors.index.json"
    groups = json.loads(index.read_text())["metadata"]["param_groups"]
    assert [(g["initial_lr"], g["weight_decay"]) for g in groups] == [(1e-3, 0.0), (1e-3, 0.0)]
    assert (
        "continuing with new settings (lr: 0.003 → 0.001; weight_decay" in capsys.readouterr().err
    )


@pytest.mark.parametrize(
    ("change", "listed"),
    [
        ({"global_batch": 8}, "global_batch: 4 → 8"),
        ({"seq_len": 16}, "seq_len: 32 → 16"),
        ({"seed": 3}, "seed: 0 → 3"),
        ({"optimizer": "sgd"}, "optimizer: 'adamw' → 'sgd'"),
    ],
)
def test_what_the_checkpoint_is_made_of_cannot_change_even_with_new_hparams(
    runs: dict[str, Any], tokens: str, tmp_path: Path, change: dict[str, Any], listed: str
) -> None:
    with pytest.raises(ValueError) as refused:
        _resume_changed(runs, tokens, tmp_path, resume_with_new_hparams=True, **change)
    message = str(refused.value)
    assert listed in message
    assert "a resumed run cannot change them" in message
    assert f"--init-from {tmp_path / 'step-00000003'}" in message


def test_a_longer_run_with_new_hparams_decays_over_the_new_length(
    runs: dict[str, Any], tokens: str, tmp_path: Path
) -> None:
    resumed = _resume_changed(runs, tokens, tmp_path, steps=8, resume_with_new_hparams=True)
    assert (resumed.first_step, len(resumed.losses)) == (3, 5)
    lrs = [r["lr"] for r in _records(tmp_path / "metrics.jsonl") if r["step"] >= 3]
    schedule = {"schedule": "cosine", "warmup_steps": 2, "total_steps": 8, "min_ratio": 0.1}
    assert lrs == pytest.approx([3e-3 * lr_factor(s, **schedule) for s in range(3, 8)])


def test_other_data_is_refused_by_name_unless_asked_for(
    runs: dict[str, Any], tokens: str, tmp_path: Path
) -> None:
    expected = r"data: .* → None\): resume with the checkpoint's \(--data"
    with pytest.raises(ValueError, match=expected):
        _resume_changed(runs, None, tmp_path)  # type: ignore[arg-type]


def test_resuming_a_finished_run_says_there_is_nothing_to_train(
    runs: dict[str, Any], tokens: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = _run_argv(tokens, runs["root"] / "full")
    assert main([*argv, "--resume"]) == 0
    out = capsys.readouterr().out
    assert "nothing to train: the checkpoint is at step 6 and --steps is 6" in out
    assert "larger --steps with --resume-with-new-hparams" in out  # cosine decays over --steps


def test_extending_a_finished_decaying_run_names_the_one_flag_that_does_it() -> None:
    saved = TrainConfig.of(**RUN).flat()
    longer = TrainConfig.of(**{**RUN, "steps": 8})
    with pytest.raises(
        ValueError, match=r"run is finished \(step 6 of --steps 6\).*add --resume-with-new-hparams"
    ):
        check_resumable(saved, longer, 6, "ck")


def test_a_refused_resume_fails_before_any_rank_is_launched(
    runs: dict[str, Any], tokens: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = _run_argv(tokens, runs["root"] / "full", global_batch=8)
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--pp", "2", "--resume"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("meshpipe: error: the checkpoint of step 6")
    assert "global_batch: 4 → 8" in err


def test_a_new_run_does_not_write_over_another_runs_checkpoints(
    runs: dict[str, Any], tokens: str, tmp_path: Path
) -> None:
    _copy_step(runs["root"] / "full", 3, tmp_path)
    before = _tensors(tmp_path / "step-00000003")
    config = TrainConfig.of(**RUN, data=tokens, checkpoint_dir=str(tmp_path), save_every=3)
    with pytest.raises(ValueError, match=r"already holds a run's checkpoints \(newest step-0+3\)"):
        train(config, progress=False)
    after = _tensors(tmp_path / "step-00000003")
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_a_step_folder_given_as_checkpoint_dir_is_refused_naming_its_parent(
    runs: dict[str, Any], tokens: str, tmp_path: Path
) -> None:
    _copy_step(runs["root"] / "full", 3, tmp_path)
    step = tmp_path / "step-00000003"
    config = TrainConfig.of(**RUN, data=tokens, checkpoint_dir=str(step), resume=True)
    with pytest.raises(
        ValueError, match=rf"is a checkpoint, not a folder .*--checkpoint-dir {tmp_path} --resume"
    ):
        train(config, progress=False)
    assert not (step / "latest").exists()


def test_the_same_token_file_named_another_way_is_the_same_data(tokens: str) -> None:
    saved = TrainConfig.of(data=tokens).flat()
    prefix = tokens.removesuffix(".bin")
    assert check_resumable(saved, TrainConfig.of(data=prefix), 3, "ck") == ""
    assert check_resumable(saved, TrainConfig.of(data=prefix + ".json"), 3, "ck") == ""
