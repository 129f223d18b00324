"""One run per checkpoint folder: an advisory lock with the owner's name in it.

Two runs writing one `--checkpoint-dir` remove each other's temporary folders and replace each
other's `latest`; one dies with an I/O error, or both live on with a mixed history. Global
rank 0 therefore holds `fcntl.flock` on `.meshpipe-owner` in the folder from before the first
step to the end of the run, and writes into it who holds it (run id, host, pid, since when), so
the run refused can name the one it collides with. The kernel drops the lock when its process
dies, so a crashed run never blocks a resume on its host; the owner it leaves in the file is
then taken over with a note. The file is emptied on release, never deleted: deleting it would
let a third run lock a fresh file while a second still holds the old one.

The lock may not span hosts on every shared filesystem, so an owner on another host that did
not release the file is believed alive: the refusal says how to clear it if that run is gone.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from engine.checkpoint.agree import rank0_decides
from engine.checkpoint.files import CheckpointError

__all__ = ["OWNER_FILE", "FolderLock", "Owner", "check_folder_free", "holding_folder"]

OWNER_FILE = ".meshpipe-owner"


@dataclass(frozen=True, kw_only=True)
class Owner:
    """Who holds a checkpoint folder."""

    run: str
    """The run's id (torchelastic's run id, or a random one for a single process)."""
    host: str
    pid: int
    since: str
    """UTC time the run took the folder, ISO 8601."""

    def __str__(self) -> str:
        return f"run {self.run} (pid {self.pid} on host {self.host}, since {self.since})"


def this_owner(run: str | None = None) -> Owner:
    """This process as an owner; the run id is torchelastic's unless it is the default."""
    elastic = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    return Owner(
        run=run or (elastic if elastic != "none" else f"meshpipe-{uuid.uuid4().hex[:8]}"),
        host=socket.gethostname(),
        pid=os.getpid(),
        since=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    )


def _read(fd: int) -> Owner | None:
    os.lseek(fd, 0, os.SEEK_SET)
    text = os.read(fd, 1 << 16).decode("utf-8", errors="replace").strip()
    try:
        return Owner(**json.loads(text)) if text else None
    except (ValueError, TypeError):
        return Owner(run="unknown (unreadable owner file)", host="?", pid=0, since="?")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _refusal(path: Path, owner: Owner | None, *, locked: bool) -> CheckpointError:
    gone = (
        "or wait until it ends"
        if locked
        else f"or, if that run is gone, remove {path} and start again"
    )
    return CheckpointError(
        f"--checkpoint-dir {path.parent} is in use by {owner or 'a run just starting'}: two "
        "runs in one folder overwrite each other's checkpoints. Give this run another "
        f"--checkpoint-dir, {gone}"
    )


class FolderLock:
    """The lock on one checkpoint folder, held from `acquire` to `release` by this process."""

    def __init__(self, root: str | Path, owner: Owner | None = None) -> None:
        self.path = Path(root) / OWNER_FILE
        self.owner = owner or this_owner()
        self._fd: int | None = None

    def _open_locked(self) -> tuple[int, bool]:
        """The owner file, opened; and whether this process now holds its flock."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            previous = _read(fd)
            os.close(fd)
            raise _refusal(self.path, previous, locked=True) from None
        except OSError:  # a filesystem without flock: the owner file alone decides
            return fd, False
        return fd, True

    def _stale_note(self, previous: Owner | None, locked: bool) -> str | None:
        """None when the folder is free; a note when `previous` is gone; else raise."""
        if previous is None or previous.run == self.owner.run:
            return None  # free, or this run restarted (--max-restarts)
        same_host = previous.host == self.owner.host
        if same_host and (locked or not _alive(previous.pid)):
            return f"took over {self.path.parent} from {previous}, which ended without releasing it"
        raise _refusal(self.path, previous, locked=False)

    def check(self) -> None:
        """Raise, naming the owner, when another run holds the folder; takes nothing."""
        if not self.path.is_file():
            return
        fd, locked = self._open_locked()
        try:
            self._stale_note(_read(fd), locked)
        finally:
            os.close(fd)

    def acquire(self) -> str | None:
        """Take the folder; returns a note when a dead run's claim was taken over."""
        fd, locked = self._open_locked()
        try:
            note = self._stale_note(_read(fd), locked)
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(asdict(self.owner)).encode("utf-8"), 0)
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        return note

    def release(self) -> None:
        """Empty the owner file, then drop the lock."""
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            os.ftruncate(self._fd, 0)
        os.close(self._fd)
        self._fd = None


def check_folder_free(root: str | Path) -> None:
    """The launcher's check before any rank starts: raise, naming the owner, when another
    run holds `root`; takes nothing."""
    FolderLock(root).check()


@contextlib.contextmanager
def holding_folder(root: str | None, rank: int) -> Iterator[str | None]:
    """Global rank 0 holds `root` for the block; every rank raises if it cannot. Yields the
    takeover note (on every rank), or None."""
    if root is None:
        yield None
        return
    lock = FolderLock(root) if rank == 0 else None
    note = rank0_decides(lambda: lock.acquire() if lock is not None else None)
    try:
        yield note
    finally:
        if lock is not None:
            lock.release()
