"""Checkpoint files written durably and fingerprinted.

Every file of a checkpoint is flushed to the disk (fsync) before the folder is renamed into place, and its
SHA-256 goes into the completion marker, so a resume can tell a damaged file from a good one. A rank that
fails to write (a full disk, say) records the error and carries on with the collectives of the save, so the
other ranks are not left waiting; the save then fails on every rank together.

With a :class:`BackgroundWrites` (``training.async_save``) the files' contents are handed over as host copies and
a thread writes, syncs and fingerprints them while training goes on.
"""

from __future__ import annotations

import hashlib
import os
import queue
import threading
from pathlib import Path

CHUNK = 1 << 24


class BackgroundWrites:
    """One thread that runs file writes in the order they are handed over. A write that raises records the
    error in its :class:`WrittenFiles`; the thread carries on with the next."""

    def __init__(self):
        self.jobs: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._run, name="checkpoint-writer", daemon=True)
        self.thread.start()

    def submit(self, job, written: WrittenFiles) -> None:
        self.jobs.put((job, written))

    def idle(self) -> bool:
        """Whether everything handed over so far is written (or has failed)."""
        return self.jobs.unfinished_tasks == 0

    def wait(self) -> None:
        self.jobs.join()

    def _run(self) -> None:
        while True:
            job, written = self.jobs.get()
            try:
                job()
            except Exception as err:  # noqa: BLE001 - any failure fails this checkpoint, not the run
                written.fail(err if isinstance(err, OSError) else OSError(f"{type(err).__name__}: {err}"))
            finally:
                self.jobs.task_done()


class WrittenFiles:
    """What one rank wrote into a folder: each file's SHA-256, and the first write error, if any. With
    ``background`` the files are written by its thread: the figures are complete once it is idle."""

    def __init__(self, background: BackgroundWrites | None = None):
        self.digests: dict[str, str] = {}
        self.error: OSError | None = None
        self.background = background

    def fail(self, err: OSError) -> None:
        self.error = self.error or err

    def run(self, job) -> None:
        """``job()`` now, or on the background thread in the order handed over."""
        if self.background is None:
            job()
        else:
            self.background.submit(job, self)

    def write(self, path: Path, data: str | bytes) -> None:
        """A small file, written and synced in one go (skipped once an earlier write failed)."""
        data = data.encode() if isinstance(data, str) else data
        self.run(lambda: self._write_now(path, data))

    def _write_now(self, path: Path, data: bytes) -> None:
        if self.error is not None:
            return
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
