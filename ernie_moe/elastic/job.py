"""A training job that Paddle's elastic launcher restarts: its attempts, kept in ``output_dir/attempts.jsonl``.

Under an etcd master the launcher restarts every worker when one dies, when a node is lost and when one joins;
ranks are reassigned and the world size may change. Each start of the trainer with a job id (``PADDLE_JOB_ID``,
which ``python -m ernie_moe.elastic`` sets) is one attempt of that job. Rank 0 appends a line when an attempt starts
(its world size, global batch, run id, the step it resumed at) and when it ends (done, stopped or failed, and why);
a process killed, or a node lost, writes no end. A restart reads the lines of its job to resume from the job's own
newest checkpoint, to keep the global batch of the first attempt, and to say how many restarts there were, at which
steps and why. The file grows by two lines a restart, never with the steps; it is read from its last
:data:`MAX_READ_BYTES` bytes.
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from ..paths import open_output

JOB_VARIABLE = "PADDLE_JOB_ID"
RECORD = "attempts.jsonl"
MAX_READ_BYTES = 1 << 20  # thousands of restarts


def job_id() -> str:
    """This process's job id under the elastic launcher; empty for a run started any other way."""
    return os.environ.get(JOB_VARIABLE, "").strip()


@dataclass
class Attempt:
    """One start of the job, and how it ended (``ended`` None: it wrote no end)."""

    number: int
    world_size: int
    global_batch: int
    step: int  # the step it started at (0: from the beginning)
    run_id: str
    host: str = ""
    started: str = ""
    ended: str | None = None  # "done", "stopped" or "failed"
    end_step: int | None = None
    reason: str = ""


class JobRecord:
    """The attempts of job ``job`` in ``output_dir``; rank 0 writes, every rank may read."""

    def __init__(self, output_dir, job: str):
        self.path = Path(output_dir) / RECORD
        self.job = job

    def attempts(self) -> list[Attempt]:
        """This job's attempts in order, with their ends; lines that cannot be read are passed over."""
        found: dict[int, Attempt] = {}
        for line in self._lines():
            try:
                entry = json.loads(line)
                if not isinstance(entry, dict) or entry.get("job") != self.job:
                    continue
                number = int(entry["attempt"])
                if entry.get("event") == "start":
                    start = Attempt(number, int(entry["world_size"]), int(entry["global_batch"]), int(entry["step"]),
                                    str(entry["run_id"]), str(entry.get("host", "")), str(entry.get("time", "")))
                    if min(start.world_size, start.global_batch) < 1 or min(start.number, start.step) < 0:
                        continue  # no attempt ran with these: not a line this package wrote
                    found[number] = start
                elif entry.get("event") == "end" and number in found:
                    found[number].ended, found[number].end_step = str(entry["status"]), int(entry["step"])
                    found[number].reason = str(entry.get("reason", ""))
            except (ValueError, KeyError, TypeError):
                continue
        return [found[n] for n in sorted(found)]

    def first_global_batch(self) -> int:
        """The global batch the job's first attempt trained with; 0 before it has started."""
        attempts = self.attempts()
        return attempts[0].global_batch if attempts else 0

    def begin(self, attempt: Attempt) -> None:
        attempt.host, attempt.started = socket.gethostname(), time.strftime("%Y-%m-%d %H:%M:%S")
        self._append({"event": "start", "attempt": attempt.number, "time": attempt.started,
                      "world_size": attempt.world_size, "global_batch": attempt.global_batch, "step": attempt.step,
                      "run_id": attempt.run_id, "host": attempt.host})

    def end(self, attempt: Attempt, status: str, step: int, reason: str = "") -> None:
        self._append({"event": "end", "attempt": attempt.number, "status": status, "step": step, "reason": reason,
                      "time": time.strftime("%Y-%m-%d %H:%M:%S")})

    def _append(self, entry: dict) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._check_regular()
        with open_output(self.path, "a") as f:
            f.write(json.dumps({"job": self.job, **entry}) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def _check_regular(self) -> None:
        """OSError when the record is there as something other than a regular file: a FIFO would block every start
        of the job, a link would have it write where the link points."""
        if self.path.is_symlink() or (self.path.exists() and not self.path.is_file()):
            raise OSError(f"'{self.path}' (the elastic job's record) is not a regular file: remove it")

    def _lines(self) -> list[str]:
        self._check_regular()
        try:
            with open(self.path, "rb") as f:
                size = f.seek(0, os.SEEK_END)
                f.seek(max(0, size - MAX_READ_BYTES))
                data = f.read(MAX_READ_BYTES)
        except OSError:
            return []
        lines = data.decode("utf-8", errors="replace").splitlines()
        return lines[1:] if size > MAX_READ_BYTES else lines  # the first may be cut


def why_restarted(previous: Attempt, world_size: int) -> str:
    """Why attempt ``previous + 1`` exists, as far as the record tells."""
    if previous.ended is None:
        why = (f"attempt {previous.number} wrote no end (a process was killed, or its node lost; the launcher's log "
               "says which)")
    else:
        why = f"attempt {previous.number} {previous.ended} at step {previous.end_step}"
        why += f": {previous.reason}" if previous.reason else ""
    if world_size != previous.world_size:
        why += f"; world size {previous.world_size} -> {world_size}"
    return why


def restart_history(attempts: list[Attempt]) -> list[dict]:
    """Each restart of the job: its attempt, the step it resumed at, its world size and why it was needed."""
    return [{"attempt": a.number, "step": a.step, "world_size": a.world_size,
             "why": why_restarted(attempts[i], a.world_size)} for i, a in enumerate(attempts[1:])]
