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

__all__ = ["MetricsLog", "plot_metrics", "plot_target", "read_records"]


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
        for fields in kept:
            self._show(fields)

    def record(self, **fields: Any) -> None:
        """Append a step's record and refresh the bar's postfix."""
        if self._file is not None:
            self._file.write(json.dumps(fields) + "\n")
            self._file.flush()
        self._show(fields)

    def say(self, line: str) -> None:
        """Print a line to stderr above the progress bar (`tqdm.write` lifts the bar), so the
        line never runs into the bar's own."""
        tqdm.write(line, file=sys.stderr)

    def _show(self, fields: dict[str, Any]) -> None:
        shown = {k: fields[k] for k in ("loss", "tokens_per_s", "bubble") if k in fields}
        self._bar.set_postfix(
            {k: (f"{v:.4f}" if k == "loss" else f"{v:.3g}") for k, v in shown.items()},
            refresh=False,
        )
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
        if not isinstance(record, dict) or "step" not in record or "loss" not in record:
            raise ValueError(
                f"{path}, line {number}: not a step record (no step and loss): give a metrics "
                "file written by meshpipe train --metrics-file"
            )
        records.append(record)
    return records


def plot_metrics(path: str | Path, out: str | Path | None = None) -> Path:
    """Loss per step from a metrics file, as a PNG at `out` (default: the metrics file's name
    with `.png`; a name without a suffix gets `.png`, as matplotlib would); returns its path."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise ValueError("plotting needs matplotlib: pip install 'meshpipe[plot]'") from error
    records = read_records(path)
    if not records:
        raise ValueError(f"metrics file {path} has no records: train with --metrics-file first")
    steps = [r["step"] + 1 for r in records]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, [r["loss"] for r in records], color="#4C72B0", label="loss")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats/token)")
    ax.grid(alpha=0.3)
    ax.set_title(f"{Path(path).name}: final loss {records[-1]['loss']:.3f}")
    fig.tight_layout()
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
