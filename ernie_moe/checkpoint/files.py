"""Checkpoint files written durably and fingerprinted.

Every file of a checkpoint is flushed to the disk (fsync) before the folder is renamed into place, and its
SHA-256 goes into the completion marker, so a resume can tell a damaged file from a good one. A rank that
fails to write (a full disk, say) records the error and carries on with the collectives of the save, so the
other ranks are not left waiting; the save then fails on every rank together.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

CHUNK = 1 << 24


class WrittenFiles:
    """What one rank wrote into a folder: each file's SHA-256, and the first write error, if any."""

    def __init__(self):
        self.digests: dict[str, str] = {}
        self.error: OSError | None = None

    def fail(self, err: OSError) -> None:
        self.error = self.error or err

    def write(self, path: Path, data: str | bytes) -> None:
        """A small file, written and synced in one go (skipped once an earlier write failed)."""
        if self.error is not None:
            return
        data = data.encode() if isinstance(data, str) else data
        try:
            with open(path, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        except OSError as err:
            self.fail(err)
            return
        self.digests[path.name] = hashlib.sha256(data).hexdigest()


def sha256_of(path: Path, sync: bool = False) -> str:
    """A file's SHA-256, read in chunks; ``sync`` also flushes it to the disk."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
        if sync:
            os.fsync(f.fileno())
    return digest.hexdigest()


def sync_folder(path: Path) -> None:
    """Make the folder's entries (new files, a rename) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
