"""Step metrics: JSON-lines records and the progress display."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from tqdm import tqdm

from engine.checkpoint.atomic import atomic_write_text

__all__ = ["EVAL_KIND", "MetricsLog", "plot_metrics", "plot_target", "read_records"]

EVAL_KIND = "eval"
"""The `kind` of a validation record ({"kind": "eval", "step", "val_loss"}); step records
have no kind."""


class MetricsLog:
    """Writes one JSON record per step and shows loss and tokens/s on a progress bar.

    Holds an open file and a bar, hence a class; use it as a context manager.
    """

    def __init__(
        self,
        *,
        total_steps: int,
        path: str | Path | None = None,
        progress: bool = True,
        kept: Sequence[dict[str, Any]] = (),
    ) -> None:
        """`kept`: a resumed run's records of the steps before it; the file is replaced by
        them in one atomic write before new records are appended, so a crash while opening
        never loses the history."""
        self._file = None
        if path is not None:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(Path(path), "".join(json.dumps(r) + "\n" for r in kept))
            self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115
        self._bar = tqdm(
            total=total_steps, disable=not progress, file=sys.stderr, unit="step", leave=True
        )
        self._postfix: dict[str, str] = {}
        self._val_loss: str | None = None
        for fields in kept:
            self._show(fields)

    def record(self, **fields: Any) -> None:
        """Append a record (a step's, or with kind "eval" a validation loss) and refresh the
        bar's postfix."""
        if self._file is not None:
            self._file.write(json.dumps(fields) + "\n")
            self._file.flush()
        self._show(fields)

    def say(self, line: str) -> None:
        """Print a line to stderr above the progress bar (`tqdm.write` lifts the bar), so the
        line never runs into the bar's own."""
        tqdm.write(line, file=sys.stderr)

    def _show(self, fields: dict[str, Any]) -> None:
        if fields.get("kind") == EVAL_KIND:  # beside the step's figures, not a step of its own
            self._val_loss = f"{fields['val_loss']:.4f}"
            self._bar.set_postfix(self._postfix, val_loss=self._val_loss, refresh=False)
            return
        shown = {k: fields[k] for k in ("loss", "tokens_per_s", "bubble") if k in fields}
        self._postfix = {k: (f"{v:.4f}" if k == "loss" else f"{v:.3g}") for k, v in shown.items()}
        if self._val_loss is not None:
            self._postfix["val_loss"] = self._val_loss
        self._bar.set_postfix(self._postfix, refresh=False)
        self._bar.update(1)

    def close(self) -> None:
        self._bar.close()
        if self._file is not None:
            self._file.close()

    def __enter__(self) -> MetricsLog:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def read_records(path: str | Path) -> list[dict[str, Any]]:
    """The records of a metrics file. A run killed mid-write leaves its last line cut short,
    which is skipped (training tolerates it too); a bad line elsewhere means the file is not
    a metrics file, and is named with its line number."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as error:
        raise ValueError(
            f"cannot read metrics file {path} ({error.strerror}): give a metrics file written "
            "by meshpipe train --metrics-file"
        ) from None
    except UnicodeDecodeError as error:
        raise ValueError(
            f"metrics file {path} is not text (byte {error.start} is not UTF-8): give a "
            "metrics file written by meshpipe train --metrics-file"
        ) from None
    numbered = [(number, line) for number, line in enumerate(lines, 1) if line.strip()]
    records = []
    for number, line in numbered:
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            if number == numbered[-1][0]:
                continue
            raise ValueError(
                f"{path}, line {number}: not a JSON record ({error}): give a metrics file "
                "written by meshpipe train --metrics-file"
            ) from error
        value = "val_loss" if isinstance(record, dict) and record.get("kind") else "loss"
        if not isinstance(record, dict) or "step" not in record or value not in record:
            raise ValueError(
                f"{path}, line {number}: not a step record (no step and loss): give a metrics "
                "file written by meshpipe train --metrics-file"
            )
        records.append(record)
    return records


def _figure(plt: Any, records: list[dict[str, Any]], name: str) -> Any:
    """Training and validation loss per step above, the learning rate below."""
    steps = [r for r in records if r.get("kind") != EVAL_KIND]
    evals = [r for r in records if r.get("kind") == EVAL_KIND]
    fig, (ax, ax_lr) = plt.subplots(
        2, 1, figsize=(7, 5.5), sharex=True, gridspec_kw={"height_ratios": [3, 1]}
    )
    if steps:
        ax.plot(
            [r["step"] + 1 for r in steps],
            [r["loss"] for r in steps],
            color="#4C72B0",
            label="training loss",
        )
    if evals:
        ax.plot(
            [r["step"] + 1 for r in evals],
            [r["val_loss"] for r in evals],
            color="#DD8452",
            marker="o",
            label="validation loss",
        )
    ax.set_ylabel("loss (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    final = [f"final loss {steps[-1]['loss']:.3f}"] if steps else []
    final += [f"val {evals[-1]['val_loss']:.3f}"] if evals else []
    ax.set_title(f"{name}: {', '.join(final)}")
    with_lr = [r for r in steps if "lr" in r]
    ax_lr.plot([r["step"] + 1 for r in with_lr], [r["lr"] for r in with_lr], color="#55A868")
    ax_lr.set_xlabel("step")
    ax_lr.set_ylabel("learning rate")
    ax_lr.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def plot_metrics(path: str | Path, out: str | Path | None = None) -> Path:
    """Training (and validation) loss and the learning rate per step from a metrics file, as
    a PNG at `out` (default: the metrics file's name with `.png`; a name without a suffix gets
    `.png`, as matplotlib would); returns its path."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise ValueError("plotting needs matplotlib: pip install 'meshpipe[plot]'") from error
    records = read_records(path)
    if not records:
        raise ValueError(f"metrics file {path} has no records: train with --metrics-file first")
    fig = _figure(plt, records, Path(path).name)
    target = plot_target(path, out)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(target, dpi=120)
    except OSError as error:
        raise ValueError(
            f"--out {target}: cannot write it ({error.strerror}): give another --out"
        ) from None
    finally:
        plt.close(fig)
    return target


def plot_target(path: str | Path, out: str | Path | None = None) -> Path:
    """Where `plot_metrics` writes the PNG of metrics file `path`."""
    target = Path(path).with_suffix(".png") if out is None else Path(out)
    return target if target.suffix else target.with_suffix(".png")
