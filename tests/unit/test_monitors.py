"""DeepSpeed's monitors as meshpipe writes them: TensorBoard scalars, CSV files and offline
Weights & Biases, with the loss of every step, tagged against the samples trained so far."""

from __future__ import annotations

import csv
import importlib.machinery
import importlib.util
import json
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from engine.config import MonitorConfig
from engine.training.config import TrainConfig
from engine.training.loop import train
from engine.training.monitors import Monitors, check_monitors

GLOBAL_BATCH = 4


def _trained(tmp_path: Path, **monitors: Any) -> list[float]:
    """Two steps of gpt-tiny writing `monitors`; the losses of its metrics file."""
    metrics = tmp_path / "metrics.jsonl"
    config = TrainConfig.of(steps=2, global_batch=GLOBAL_BATCH, micro_batches=2, seq_len=32,
                            metrics_file=str(metrics), **monitors)  # fmt: skip
    train(config, progress=False)
    return [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]


def test_csv_files_hold_the_loss_of_every_step_as_deepspeed_names_them(tmp_path: Path) -> None:
    losses = _trained(tmp_path, csv_dir=str(tmp_path / "csv" / "job"))
    with (tmp_path / "csv" / "job" / "Train_Samples_train_loss.csv").open() as file:
        rows = list(csv.reader(file))
    assert rows[0] == ["step", "train_loss"]
    assert [(int(s), float(v)) for s, v in rows[1:]] == [(4, losses[0]), (8, losses[1])]


def test_tensorboard_holds_the_loss_of_every_step(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard", reason="pip install tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    losses = _trained(tmp_path, tensorboard_dir=str(tmp_path / "tb"))
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    scalars = events.Scalars("Train/Samples/train_loss")
    assert [e.step for e in scalars] == [GLOBAL_BATCH, 2 * GLOBAL_BATCH]
    assert [e.value for e in scalars] == pytest.approx(losses, rel=1e-6)


def _fake_wandb(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """A stand-in wandb module that records what it is given."""
    seen: dict[str, Any] = {"logged": []}
    module = types.ModuleType("wandb")
    module.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
    module.init = lambda **kwargs: (
        seen.update(init=kwargs)
        or types.SimpleNamespace(  # type: ignore[attr-defined]
            finish=lambda: seen.update(finished=True)
        )
    )
    module.log = lambda data, step: seen["logged"].append((data, step))  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "wandb", module)
    return seen


def test_wandb_logs_every_loss_offline(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _fake_wandb(monkeypatch)
    with Monitors(MonitorConfig(wandb_project="p", wandb_group="g")) as monitors:
        monitors.write(4, {"train_loss": 5.5})
    assert seen["init"] == {"project": "p", "group": "g", "mode": "offline"}
    assert seen["logged"] == [({"Train/Samples/train_loss": 5.5}, 4)] and seen["finished"]


def test_a_monitor_without_its_package_is_refused_by_flag(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match="--wandb-project .* needs the wandb package"):
        check_monitors(MonitorConfig(wandb_project="p"))


def test_ranks_other_than_0_write_nothing(tmp_path: Path) -> None:
    with Monitors(MonitorConfig(csv_dir=str(tmp_path / "csv")), enabled=False) as monitors:
        monitors.write(4, {"train_loss": 5.5})
    assert not (tmp_path / "csv").exists()


def test_log_phases_adds_rank_0s_times_to_the_log_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _trained(tmp_path, log_every=1, log_phases=True)
    lines = [line for line in capsys.readouterr().err.splitlines() if "step 2:" in line]
    assert "; ms F " in lines[0] and " B " in lines[0] and "optimizer" in lines[0]


@pytest.mark.parametrize(
    ("settings", "scales"),
    [({"loss_scale": 128.0}, [128, 128]), ({"initial_scale_power": 3}, [8, 8])],
)
def test_the_fp16_loss_scale_settings_reach_the_run(
    tmp_path: Path, settings: dict[str, Any], scales: list[float]
) -> None:
    _trained(tmp_path, precision="fp16", csv_dir=str(tmp_path / "csv"), **settings)
    with (tmp_path / "csv" / "Train_Samples_loss_scale.csv").open() as file:
        rows = list(csv.reader(file))[1:]
    assert [float(value) for _, value in rows] == scales
