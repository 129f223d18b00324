"""Rank 0's per-step values written where DeepSpeed's monitors write them: TensorBoard
scalars, CSV files and Weights & Biases (offline), each tagged `Train/Samples/<name>` against
the samples trained so far, as DeepSpeed's engine tags its events.

`--metrics-file` stays meshpipe's own record; these writers are for the tools a DeepSpeed
user already points at `output_path/job_name`. Each is optional and needs its package
(`check_monitors` names the missing one before any rank starts).
"""

from __future__ import annotations

import csv
import importlib.util
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol

from engine.config import MonitorConfig, require

__all__ = ["Monitors", "check_monitors", "csv_file_name"]

_TAG = "Train/Samples/{}"


def csv_file_name(tag: str) -> str:
    """The file DeepSpeed's csv_monitor writes a tag into (`Train_Samples_train_loss.csv`)."""
    return tag.replace("/", "_").replace(" ", "_") + ".csv"


def check_monitors(config: MonitorConfig) -> None:
    """Refuse, naming the flag and the package, a monitor whose package is not installed."""
    for given, package, flag in (
        (config.tensorboard_dir, "tensorboard", "--tensorboard-dir (DeepSpeed's tensorboard)"),
        (config.wandb_project, "wandb", "--wandb-project (DeepSpeed's wandb)"),
    ):
        require(
            given is None or importlib.util.find_spec(package) is not None,
            f"{flag} needs the {package} package, which is not installed: pip install "
            f"{package}, or drop it",
        )


class _Writer(Protocol):
    def write(self, tag: str, value: float, samples: int) -> None: ...

    def close(self) -> None: ...


class _TensorBoard:
    def __init__(self, folder: str) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=folder)

    def write(self, tag: str, value: float, samples: int) -> None:
        self._writer.add_scalar(tag, value, samples)

    def close(self) -> None:
        self._writer.close()


class _Csv:
    """One file per tag, a `step,<name>` header, appended to (a resumed run goes on)."""

    def __init__(self, folder: str) -> None:
        self._folder = Path(folder)
        self._folder.mkdir(parents=True, exist_ok=True)

    def write(self, tag: str, value: float, samples: int) -> None:
        path = self._folder / csv_file_name(tag)
        new = not path.is_file() or path.stat().st_size == 0
        with path.open("a", newline="", encoding="utf-8") as file:
            writer = csv.writer(file)
            if new:
                writer.writerow(["step", tag.rsplit("/", 1)[-1]])
            writer.writerow([samples, value])

    def close(self) -> None:
        pass


class _Wandb:
    def __init__(self, project: str, group: str | None) -> None:
        import wandb

        self._wandb: Any = wandb
        self._run = wandb.init(project=project, group=group, mode="offline")

    def write(self, tag: str, value: float, samples: int) -> None:
        self._wandb.log({tag: value}, step=samples)

    def close(self) -> None:
        self._run.finish()


class Monitors:
    """The writers a `MonitorConfig` asks for (none on ranks other than 0); a context
    manager, as each holds an open file or run."""

    def __init__(self, config: MonitorConfig, *, enabled: bool = True) -> None:
        self._writers: list[_Writer] = []
        if not enabled:
            return
        check_monitors(config)
        if config.tensorboard_dir is not None:
            self._writers.append(_TensorBoard(config.tensorboard_dir))
        if config.csv_dir is not None:
            self._writers.append(_Csv(config.csv_dir))
        if config.wandb_project is not None:
            self._writers.append(_Wandb(config.wandb_project, config.wandb_group))

    def write(self, samples: int, values: dict[str, float]) -> None:
        """Each of `values` (train_loss, lr, loss_scale) at `samples` trained so far."""
        for writer in self._writers:
            for name, value in values.items():
                writer.write(_TAG.format(name), value, samples)

    def close(self) -> None:
        for writer in self._writers:
            writer.close()

    def __enter__(self) -> Monitors:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
