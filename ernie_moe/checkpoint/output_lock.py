"""One job writes into an output folder at a time.

Rank 0 of a run holds an exclusive ``flock`` on ``output_dir/.run.lock`` for the life of its process, with the
holder's host, process id and start time written inside. The kernel releases the lock when the process ends,
however it ends (kill -9 included), so a dead job leaves no stale lock; a second job (a fresh run, a resume or an
overwrite) finds the lock taken and stops before it reads or removes anything, naming the holder. A process that
already holds the lock (a run resumed in the same process) takes it again.

A restart of an elastic job (the same job id, ``elastic.job``) takes the lock over from an earlier attempt of that
job still holding it: a rank 0 orphaned when its launcher or node went away, blocked in a collective with peers that
are gone. On the same host, where its environment shows it is a worker of the job, it is told to stop (SIGTERM, then
SIGKILL after :data:`STOP_GRACE_S`); otherwise the restart waits up to :data:`REMOTE_WAIT_S` for it to let go. Any
other job is still refused at once.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import signal
import socket
import stat
import time
from pathlib import Path

from ..config.errors import ConfigError
from ..elastic.job import JOB_VARIABLE

LOCK_FILE = ".run.lock"
_HELD: dict[str, int] = {}  # resolved output folder -> the open lock file of this process
STOP_GRACE_S = 30.0  # an earlier attempt told to stop has this long before SIGKILL (the launcher's own grace)
REMOTE_WAIT_S = 120.0  # how long a restart waits for an earlier attempt on another host to let go
POLL_S = 0.2


def lock_output_dir(output_dir, job: str = "", say=print) -> None:
    """Take ``output_dir``'s lock for this process, or raise ConfigError naming the job that holds it. ``job``:
    this process's elastic job id; a holder of the same job is an earlier attempt, whose lock is taken over."""
    root = Path(output_dir)
    root.mkdir(parents=True, exist_ok=True)
    key = str(root.resolve())
    if key in _HELD:
        return
    fd = _open_lock(root / LOCK_FILE)
    if not _try_lock(fd):
        saved = _saved_holder(fd)
        if not (job and saved.get("job") == job and _take_over(fd, saved, root, say)):
            os.close(fd)
            raise ConfigError(f"training.output_dir '{root}' is in use by a running job ({_describe(saved)}): wait "
                              "for it to end, or choose another output_dir.")
    os.ftruncate(fd, 0)
    os.write(fd, json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "job": job,
                             "started": time.strftime("%Y-%m-%d %H:%M:%S")}).encode())
    os.fsync(fd)
    _HELD[key] = fd


def _open_lock(path: Path) -> int:
    """The lock file, opened without following a symbolic link (one would make the run write its lock line into
    whatever file the link names) and refused unless it is a regular file."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise ConfigError(f"'{path}' is a symbolic link: the run writes its lock there and follows no link; "
                              "remove it") from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ConfigError(f"'{path}' is not a regular file (the run's lock file): remove it")
    return fd


def note_attempt(output_dir, attempt: int) -> None:
    """Add the elastic job's attempt number to the holder's line of a lock this process holds."""
    fd = _HELD.get(str(Path(output_dir).resolve()))
    if fd is None:
        return
    saved = _saved_holder(fd)
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps({**saved, "attempt": attempt}).encode(), 0)
    os.fsync(fd)


def release_output_dir(output_dir) -> None:
    """Let go of ``output_dir``'s lock (the end of a run); nothing when this process does not hold it."""
    fd = _HELD.pop(str(Path(output_dir).resolve()), None)
    if fd is not None:
        os.close(fd)


def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def _take_over(fd: int, saved: dict, root: Path, say) -> bool:
    """Wait for the earlier attempt in ``saved`` to let go of the lock, telling it to stop where it runs on this
    host; whether the lock is now this process's."""
    pid = saved.get("pid")
    say(f"taking over training.output_dir '{root}' from an earlier attempt of job {saved['job']} "
        f"({_describe(saved)})", flush=True)
    # signalled only when this host's process of that number is one of the job's (a number may be reused)
    ours = isinstance(pid, int) and saved.get("host") == socket.gethostname() and _runs_job(pid, saved["job"])
    signals = [(signal.SIGTERM, STOP_GRACE_S), (signal.SIGKILL, STOP_GRACE_S)] if ours else [(None, REMOTE_WAIT_S)]
    for sig, wait in signals:
        if sig is not None and isinstance(pid, int):
            try:
                os.kill(pid, sig)
            except OSError:  # gone already: the lock tells
                pass
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if _try_lock(fd):
                return True
            time.sleep(POLL_S)
    return _try_lock(fd)


def _runs_job(pid, job: str) -> bool:
    """Whether process ``pid`` of this host is a worker of elastic job ``job`` (its environment says so)."""
    if not isinstance(pid, int) or pid <= 1 or pid == os.getpid():
        return False
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            environ = f.read(1 << 20).split(b"\0")
    except OSError:
        return False
    return f"{JOB_VARIABLE}={job}".encode() in environ


def _saved_holder(fd: int) -> dict:
    """What the holder wrote into the lock file (bounded: a holder's line is short); {} when unreadable."""
    try:
        saved = json.loads(os.pread(fd, 4096, 0).decode())
    except (OSError, ValueError):
        return {}
    return saved if isinstance(saved, dict) else {}


def _describe(saved: dict) -> str:
    try:
        job = f"job {saved['job']}, " if saved.get("job") else ""
        job += f"attempt {saved['attempt']}, " if "attempt" in saved else ""
        return f"{job}host {saved['host']}, process {saved['pid']}, since {saved['started']}"
    except KeyError:
        return "its holder did not say who it is"
