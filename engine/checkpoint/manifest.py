"""A checkpoint's manifest: the sha256 of every metadata file a resume reads.

The shards are vouched for by the sha256 their index records; the manifest closes the chain by
vouching for the indexes themselves, `trainer.json` (step, loader position, LR scheduler, loss
scale) and the RNG states. A flipped byte or an edited value in any of them (`"last_epoch": 6`
made 7 silently changes the learning rate) then fails the load by name, like a corrupt shard,
and `--resume-fallback` moves on to the previous checkpoint. The manifest records a digest of
its own entries too, so a damaged manifest is named as such rather than blamed on a good file.

Written last, inside the temporary step folder, so it is part of the atomic rename.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Collection
from pathlib import Path

from engine.checkpoint.atomic import atomic_write_text, sha256_file
from engine.checkpoint.files import CheckpointError, check_sha256

__all__ = ["MANIFEST", "unverified_note", "verify_manifest", "write_manifest"]

MANIFEST = "manifest.json"
_SHARD_SUFFIX = ".safetensors"  # checked against their index, which the manifest covers
_FORMAT = "meshpipe-manifest/1"


def _entries_digest(entries: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(entries, sort_keys=True).encode("utf-8")).hexdigest()


def write_manifest(directory: Path) -> None:
    """Record the sha256 of every file in `directory` but the shards (and the manifest)."""
    entries = {
        p.name: sha256_file(p)
        for p in sorted(directory.iterdir())
        if p.is_file() and p.name != MANIFEST and not p.name.endswith(_SHARD_SUFFIX)
    }
    body = {"format": _FORMAT, "sha256": entries, "manifest_sha256": _entries_digest(entries)}
    atomic_write_text(directory / MANIFEST, json.dumps(body, indent=1) + "\n")


def unverified_note(directory: Path) -> str | None:
    """The warning for a checkpoint written before meshpipe checksummed its metadata."""
    if (directory / MANIFEST).is_file():
        return None
    return (
        f"{directory} has no {MANIFEST} (saved by an earlier meshpipe): its trainer.json and "
        "indexes are used unverified; the next checkpoint this run saves has one"
    )


def _read(path: Path) -> dict[str, str]:
    """The manifest's entries, after checking the manifest against its own digest."""
    try:
        body = json.loads(path.read_text(encoding="utf-8"))
        entries = body["sha256"]
        intact = isinstance(entries, dict) and body["manifest_sha256"] == _entries_digest(entries)
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError):
        intact = False
    if not intact:
        raise CheckpointError(f"{path} is unreadable or fails its own sha256: the file is corrupt")
    return dict(entries)


def verify_manifest(directory: Path, names: Collection[str] | None = None) -> None:
    """Check the files the manifest lists (those in `names`, the files the caller will read,
    or all) against their sha256.

    A checkpoint without a manifest, written by a meshpipe before it had one, is accepted
    (the launcher says so: `unverified_note`): its shards and RNG states are still checked
    against its indexes and `trainer.json` as they always were, and refusing it would strand
    the run, since nothing but a resume can save it again with a manifest. A bit flip cannot
    delete a file, so only a deliberate removal takes this path."""
    path = directory / MANIFEST
    if not path.is_file():
        return
    for name, want in _read(path).items():
        file = directory / name
        if names is not None and name not in names:
            continue
        if not file.is_file():
            raise CheckpointError(f"{file} does not exist: the checkpoint is incomplete")
        check_sha256(file, want, recorded_in=path)
