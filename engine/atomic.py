"""Durable, all-or-nothing file writes: what the token files and the checkpoints share.

A file is written under a temporary name in its own folder, fsynced, then renamed over the
target, so a reader (or a crash) sees the old file or the new one, never half of either.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

__all__ = ["atomic_write", "atomic_write_text", "fsync_dir", "fsync_file"]


def atomic_write(path: Path, write: Callable[[IO[bytes]], Any]) -> Any:
    """Call `write` on a temp file next to `path`, fsync it, rename it to `path`."""
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            result = write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_name, path)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    return result


def fsync_dir(path: Path) -> None:
    """Make a rename or a new entry in `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: Path) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def atomic_write_text(path: Path, text: str) -> None:
    """`atomic_write` of UTF-8 text, then the folder fsynced so the rename survives a crash."""
    atomic_write(path, lambda f: f.write(text.encode("utf-8")))
    fsync_dir(path.parent)
