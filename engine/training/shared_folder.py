"""The check, before the first step, that every rank sees the checkpoint folder.

A checkpoint is written by every rank into one folder and completed by rank 0, so ranks on
hosts with separate folders (a local disk each, or a relative path resolved against each
host's working directory) would fail only at the first save, after hours of training. Rank 0
writes a token holding a random nonce into the folder; every rank reads it back, and the ranks
that cannot are named on every rank, which all raise the same error.
"""

from __future__ import annotations

import secrets
import socket
from pathlib import Path

import torch.distributed as dist

from engine.comm.collective import naming_failures
from engine.comm.mesh import Mesh

__all__ = ["TOKEN_PREFIX", "check_shared_folder"]

TOKEN_PREFIX = ".meshpipe-shared-"
"""Name of the token file rank 0 writes (followed by the nonce) and removes."""


def _write_token(token: Path, nonce: str) -> str | None:
    """Rank 0's write; the reason it failed, or None."""
    try:
        token.write_text(nonce, encoding="utf-8")
    except OSError as error:
        return f"rank 0 cannot write {token} ({error.strerror})"
    return None


def _sees(token: Path, nonce: str) -> bool:
    try:
        return token.read_text(encoding="utf-8") == nonce
    except OSError:
        return False


def check_shared_folder(folder: str, mesh: Mesh, *, flag: str, timeout_s: float) -> None:
    """Raise on every rank unless every rank reads the token rank 0 wrote into `folder`."""
    if mesh.world_size == 1:
        return
    with naming_failures(f"the check that every rank sees {flag} {folder}", timeout_s=timeout_s):
        sent: list[object] = [secrets.token_hex(16), None]
        token = Path(folder) / f"{TOKEN_PREFIX}{sent[0]}"
        if mesh.rank == 0:
            sent[1] = _write_token(token, str(sent[0]))
        dist.broadcast_object_list(sent, src=0)
        nonce, failed = str(sent[0]), sent[1]
        if failed is not None:
            raise ValueError(f"{flag} {folder}: {failed}: give a folder every rank can write")
        token = Path(folder) / f"{TOKEN_PREFIX}{nonce}"
        mine = (_sees(token, nonce), socket.gethostname(), str(Path(folder).resolve()))
        views: list[tuple[bool, str, str]] = [mine] * mesh.world_size
        dist.all_gather_object(views, mine)
    if mesh.rank == 0:
        token.unlink(missing_ok=True)
    blind = [
        f"rank {r} (host {host}, {where})" for r, (ok, host, where) in enumerate(views) if not ok
    ]
    if blind:
        _, host, where = views[0]
        raise ValueError(
            f"{flag} {folder} is not one folder for every rank: {', '.join(blind)} cannot see "
            f"the file rank 0 (host {host}) wrote into {where}, and a checkpoint is written by "
            f"every rank into one folder. Give a {flag} on a filesystem every host mounts (NFS, "
            "Lustre, a shared cloud volume), by the same absolute path on each host"
        )
