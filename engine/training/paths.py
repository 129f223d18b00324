"""No output of a command is one of its inputs or another of its outputs.

Every command lists the paths its flags name as `PathUse`s and calls `check_paths` before it
writes anything: a metrics file named like the token header it trains on, or a schedule saved
into a checkpoint, would otherwise destroy the input silently and fail a later run.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from engine.checkpoint.files import LATEST, TRAINER_FILE, has_checkpoint
from engine.checkpoint.owner import OWNER_FILE
from engine.training.data import token_file_pair

__all__ = [
    "PathUse",
    "check_paths",
    "checkpoint_in",
    "checkpoint_root",
    "file_in",
    "file_out",
    "folder_out",
    "token_file",
    "tree_in",
    "tree_out",
]

_ROOT_OWNED = re.compile(rf"^(step-\d{{8}}|{LATEST}|\.tmp-.*|\.trash-.*|{re.escape(OWNER_FILE)})$")
"""What a checkpoint root's run owns inside it; other files there (a metrics file) are free."""


Owns = Literal["file", "tree", "root", "adds"]


@dataclass(frozen=True)
class PathUse:
    """One path a command's flag names: what it covers and whether the command writes it."""

    flag: str
    given: str
    paths: tuple[Path, ...]
    output: bool
    owns: Owns = "file"
    """file: the paths themselves; tree: also all under them; root: a checkpoint folder's
    step folders, `latest` and temporary folders under them; adds: a folder the command only
    adds its own new files to (two of these may share one)."""

    def covers(self, path: Path) -> bool:
        """`path` is one of this flag's paths or lies in what it owns."""
        for mine in self.paths:
            if _same(mine, path):
                return True
            if not path.is_relative_to(mine) or self.owns in ("file", "adds"):
                continue
            if self.owns == "tree" or _ROOT_OWNED.match(path.relative_to(mine).parts[0]):
                return True
        return False

    def __str__(self) -> str:
        return f"{self.flag} {self.given}"


def _same(a: Path, b: Path) -> bool:
    return a == b or (a.exists() and b.exists() and os.path.samefile(a, b))


def _use(flag: str, given: str | Path, paths: Sequence[Path], output: bool, owns: Owns) -> PathUse:
    resolved = tuple(Path(p).resolve() for p in paths)
    return PathUse(flag, str(given), resolved, output, owns)


def file_in(flag: str, given: str | Path) -> PathUse:
    """A file the command reads."""
    return _use(flag, given, [Path(given)], False, "file")


def file_out(flag: str, given: str | Path, written: str | Path | None = None) -> PathUse:
    """A file the command writes (`written` where it is not the path as given)."""
    return _use(flag, given, [Path(written or given)], True, "file")


def folder_out(flag: str, given: str | Path) -> PathUse:
    """A folder the command adds its own new files to (TensorBoard, CSV monitors)."""
    return _use(flag, given, [Path(given)], True, "adds")


def tree_in(flag: str, given: str | Path) -> PathUse:
    """A file or folder the command reads, everything under it included (a checkpoint)."""
    return _use(flag, given, [Path(given)], False, "tree")


def tree_out(flag: str, given: str | Path) -> PathUse:
    """A folder the command fills (an exported model, an imported checkpoint)."""
    return _use(flag, given, [Path(given)], True, "tree")


def checkpoint_in(flag: str, given: str | Path) -> PathUse:
    """A checkpoint the command reads: all of a checkpoint folder, or what a folder of
    checkpoints owns (its steps and `latest`); anything else (a Hugging Face folder) whole."""
    path = Path(given)
    if has_checkpoint(path) and not (path / TRAINER_FILE).is_file():
        return checkpoint_root(flag, given, output=False)
    return tree_in(flag, given)


def token_file(flag: str, given: str | Path, *, output: bool = False) -> PathUse:
    """A token file: its `.bin` and its `.json` header, whichever of them or the prefix is
    given."""
    return _use(flag, given, token_file_pair(given), output, "file")


def checkpoint_root(flag: str, given: str | Path, *, output: bool = True) -> PathUse:
    """A folder of checkpoints (`--checkpoint-dir`): a run writes and resumes its steps."""
    return _use(flag, given, [Path(given)], output, "root")


def check_paths(uses: Sequence[PathUse]) -> None:
    """Refuse, before anything is written, an output that is (or lies in) another flag's path,
    or that lies in an existing checkpoint."""
    for i, out in enumerate(uses):
        if not out.output:
            continue
        for path in out.paths:
            _not_in_a_checkpoint(out, path)
        for j, other in enumerate(uses):
            if i != j and _overlap(out, other):
                raise ValueError(_message(out, other))


def _overlap(a: PathUse, b: PathUse) -> bool:
    """Two folders that only gain new files never clash, nor does such a folder with a folder of
    checkpoints it is (its files are not named like steps)."""
    kinds = {a.owns, b.owns}
    if kinds == {"adds"} or (kinds == {"adds", "root"} and a.paths == b.paths):
        return False
    return any(b.covers(p) for p in a.paths) or any(a.covers(p) for p in b.paths)


def _message(out: PathUse, other: PathUse) -> str:
    fix = f"give {out.flag} another path"
    if not other.output:
        return f"{out} would write over or into {other}, which this command reads: {fix}"
    if other.owns == "root" or out.owns == "root":
        root, inside = (out, other) if out.owns == "root" else (other, out)
        return (
            f"{inside} lies where {root} keeps its checkpoints (step folders, {LATEST}), so "
            f"one would destroy the other: give {inside.flag} another path"
        )
    return (
        f"{out} and {other} write to the same place, so one would destroy the other's "
        f"output: give {out.flag} and {other.flag} different paths"
    )


def _not_in_a_checkpoint(out: PathUse, path: Path) -> None:
    for folder in path.parents:
        if (folder / TRAINER_FILE).is_file():
            raise ValueError(
                f"{out} lies inside the checkpoint {folder}, which writing there would "
                f"corrupt: give {out.flag} a path outside it"
            )
