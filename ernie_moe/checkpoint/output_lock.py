"""One job writes into an output folder at a time.

Rank 0 of a run holds an exclusive ``flock`` on ``output_dir/.run.lock`` for the life of its process, with the
holder's host, process id and start time written inside. The kernel releases the lock when the process ends,
however it ends (kill -9 included), so a dead job leaves no stale lock; a second job (a fresh run, a resume or an
overwrite) finds the lock taken and stops before it reads or removes anything, naming the holder. A process that
already holds the lock (a run resumed in the same process) takes it again.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path

from ..config.errors import ConfigError

LOCK_FILE = ".run.lock"
_HELD: dict[str, int] = {}  # resolved output folder -> the open lock file of this process


def lock_output_dir(output_dir) -> None:
    """Take ``output_dir``'s lock for this process, or raise ConfigError naming the job that holds it."""
    root = Path(output_dir)
    root.mkdir(parents=True, exist_ok=True)
    key = str(root.resolve())
    if key in _HELD:
        return
    path = root / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder(fd)
        os.close(fd)
        raise ConfigError(f"training.output_dir '{root}' is in use by a running job ({holder}): wait for it to end, "
                          "or choose another output_dir.") from None
    os.ftruncate(fd, 0)
    os.write(fd, json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                             "started": time.strftime("%Y-%m-%d %H:%M:%S")}).encode())
    os.fsync(fd)
    _HELD[key] = fd


def release_output_dir(output_dir) -> None:
    """Let go of ``output_dir``'s lock (the end of a run); nothing when this process does not hold it."""
    fd = _HELD.pop(str(Path(output_dir).resolve()), None)
    if fd is not None:
        os.close(fd)


def _holder(fd: int) -> str:
    """Who holds the lock, as its file says (bounded: a holder's line is short)."""
    try:
        saved = json.loads(os.pread(fd, 4096, 0).decode())
        return f"host {saved['host']}, process {saved['pid']}, since {saved['started']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "its holder did not say who it is"
