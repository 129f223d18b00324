"""Durable, all-or-nothing file writes: what the token files and the checkpoints share.

A file is written under a temporary name in its own folder, fsynced, then renamed over the
target, so a reader (or a crash) sees the old file or the new one, never half of either.

Files get the mode a plain `open(path, "w")` gives (`0o666 & ~umask`), not the owner-only
0600 of `tempfile.mkstemp`: token files, checkpoints and exports are meant to be shared.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import threading
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

__all__ = [
    "atomic_write",
    "atomic_write_text",
    "default_file_mode",
    "fsync_dir",
    "fsync_file",
    "make_shareable",
    "sha256_file",
]

_umask_lock = threading.Lock()
_umask_fallback: int | None = None


def _umask() -> int:
    """The process umask, read without changing it where the OS allows.

    Linux reports it in /proc/self/status; elsewhere it is read once by the set-and-restore
    `os.umask` dance (process-global, hence once and under a lock) and remembered.
    """
    global _umask_fallback
    try:
        with open("/proc/self/status", encoding="ascii", errors="replace") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    with _umask_lock:
        if _umask_fallback is None:
            _umask_fallback = os.umask(0o077)
            os.umask(_umask_fallback)
        return _umask_fallback


def default_file_mode() -> int:
    """The permission bits `open(path, "w")` gives a new file: `0o666 & ~umask`."""
    return 0o666 & ~_umask()


def make_shareable(path: Path) -> None:
    """Give a file written by a library with a private temp file (safetensors' `save_file`
    writes 0600) the mode a plain `open()` would have given it."""
    os.chmod(path, default_file_mode())


def _create_temp(path: Path) -> tuple[int, Path]:
    """A new, empty file next to `path`, created as `open()` creates files: the kernel applies
    the umask (and any default ACL) to 0o666, so no umask is read and nothing races."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    for _ in range(100):
        tmp = path.parent / f".{path.name}.{secrets.token_hex(6)}.tmp"
        try:
            return os.open(tmp, flags, 0o666), tmp
        except FileExistsError:
            continue
    raise FileExistsError(f"no free temporary name next to {path}")


def atomic_write(path: Path, write: Callable[[IO[bytes]], Any]) -> Any:
    """Call `write` on a temp file next to `path`, fsync it, rename it to `path`.

    The rename itself is made durable by `fsync_dir(path.parent)`, left to the caller so that
    a folder of files needs one; `atomic_write_text` does it for a single file."""
    fd, tmp = _create_temp(path)
    try:
        with os.fdopen(fd, "wb") as f:
            result = write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return result


def fsync_dir(path: Path) -> None:
    """Make a rename or a new entry in `path` durable."""
    _fsync(path)


def fsync_file(path: Path) -> None:
    """Make a file another writer finished (safetensors' `save_file`) durable."""
    _fsync(path)


def _fsync(path: Path) -> None:
    """fsync through a read-only descriptor: a file written under a strict umask (0o277
    leaves it read-only) must not fail here."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_text(path: Path, text: str) -> None:
    """`atomic_write` of UTF-8 text, then the folder fsynced so the rename survives a crash."""
    atomic_write(path, lambda f: f.write(text.encode("utf-8")))
    fsync_dir(path.parent)


def sha256_file(path: Path) -> str:
    """The file's sha256, read in 1 MiB blocks: what a checkpoint's index and a token file's
    header record to vouch for their files."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
