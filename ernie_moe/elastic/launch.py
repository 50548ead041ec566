"""``python -m ernie_moe.elastic``: Paddle's elastic launcher, with what it leaves to its user done for them.

``python -m ernie_moe.elastic --master etcd://HOST:PORT --job_id J [launcher options] run_trainer.py --config F``
runs ``python -m paddle.distributed.launch`` with the same options, after:

- checking that etcd answers and that its client is installed (one clear line otherwise, not a 16 s traceback);
- setting what the launcher needs on a current Python stack: ``PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION=python``
  (the ``etcd3`` client's generated code predates protobuf 4) and ``GRPC_ENABLE_FORK_SUPPORT=false`` (grpcio
  >= 1.80 sometimes aborts a freshly forked worker otherwise);
- passing the job id to the workers (``PADDLE_JOB_ID``; the launcher keeps ``--job_id`` to itself), which is what
  makes each start of the trainer an attempt of the job (``elastic.job``), resumed on a restart;
- ``--elastic_level 1`` unless given (a dead worker restarts the pod).

When Paddle's launcher itself gives up before the job finished (exits with an error code while etcd answers:
a restart that met a slow or vanished peer ends it with "peer not ready"), it is started again, up to
``--max_restart`` times, and the workers resume from the job's newest checkpoint. Afterwards it says how the job
ended. Paddle's launcher exits with code 0 when etcd dies under it, leaving its
workers running; here that becomes a line naming etcd and exit code :data:`ETCD_LOST`. This process is the
workers' subreaper, so those orphans (which stop after their step with a checkpoint when their launcher is gone)
are waited for before it exits. Paddle is not imported here.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from importlib.util import find_spec
from pathlib import Path

from .job import JOB_VARIABLE

FINISHED_VARIABLE = "ERNIE_MOE_ELASTIC_FINISHED"  # a folder where a worker that finishes the run says so
USAGE = 2  # a command that cannot start
ETCD_LOST = 3  # etcd went away while the job ran
STOPPED = 4  # a worker's code for "stopped on request, checkpoint saved" (training.stop.EXIT_CODE)
DEFAULT_MAX_RESTART = 3  # Paddle's launcher's own default for --max_restart
ORPHAN_WAIT_S = 300.0  # how long the workers a dead launcher left may take to save and stop
PR_SET_CHILD_SUBREAPER = 36
ENVIRONMENT = {"PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION": "python", "GRPC_ENABLE_FORK_SUPPORT": "false"}


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    master, job = _option(args, "--master"), _option(args, "--job_id") or os.environ.get(JOB_VARIABLE, "")
    problem = _problem(master, job, args)
    host, port = _address(master or "")
    if problem or port is None:  # _problem names a missing port too
        print(f"elastic: {problem}", file=sys.stderr)
        return USAGE
    args = _without(args, "--job_id")
    if _option(args, "--elastic_level") is None:
        args = ["--elastic_level", "1", *args]
    finished = Path(tempfile.mkdtemp(prefix="ernie_moe_elastic_"))
    env = {**os.environ, **{k: os.environ.get(k, v) for k, v in ENVIRONMENT.items()},
           JOB_VARIABLE: job, FINISHED_VARIABLE: str(finished)}
    _become_subreaper()
    told: list[str] = []
    launcher: subprocess.Popen | None = None

    def forward(signum, frame):  # the launcher stops its workers, which save their step and exit
        told.append(signal.Signals(signum).name)
        if launcher is not None:
            launcher.send_signal(signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    relaunches, most = 0, int(_option(args, "--max_restart") or DEFAULT_MAX_RESTART)
    try:
        while True:
            launcher = subprocess.Popen([sys.executable, "-m", "paddle.distributed.launch", *args], env=env)
            code = launcher.wait()
            orphans = _wait_for_orphans()
            unfixable = any(finished.glob("unfixable-*"))  # a worker's config or data error: a restart repeats it
            if _finished(finished) or told or code <= 0 or unfixable or relaunches >= most or not _answers(host, port):
                break
            # the launcher gave up (a restart that met a slow or vanished peer: "peer not ready"); the job goes on
            relaunches += 1
            print(f"elastic: job {job}: Paddle's launcher ended with code {code} before the job finished; starting it "
                  f"again ({relaunches} of --max_restart {most}): the workers resume from the job's newest "
                  "checkpoint", file=sys.stderr, flush=True)
    finally:
        done = _finished(finished)
        shutil.rmtree(finished, ignore_errors=True)
    if done:
        return 0
    return _ended(job, code, orphans, told, host, port)


def _ended(job: str, code: int, orphans: list[int], told: list[str], host: str, port: int) -> int:
    """The line saying why the job did not finish, and the command's exit code."""
    left = ""
    if orphans:
        saved = all(c == STOPPED for c in orphans)
        left = (f"; the {len(orphans)} worker(s) it left " +
                ("saved a checkpoint and stopped" if saved else f"ended with exit codes {orphans}"))
    if told:
        print(f"elastic: job {job} stopped on {told[0]}: the launcher stopped its workers, which save their step; run "
              "the same command to resume the job.", file=sys.stderr)
        return STOPPED
    if not _answers(host, port):
        print(f"elastic: job {job} did not finish: etcd at {host}:{port} stopped answering and Paddle's launcher gave "
              f"up (exit code {code}){left}. Start etcd again and run the same command to resume the job.",
              file=sys.stderr)
        return ETCD_LOST
    if code < 0:
        print(f"elastic: job {job} failed: the launcher was killed by signal {-code}{left}", file=sys.stderr)
        return 128 - code  # as a shell reports it
    if code != 0:
        print(f"elastic: job {job} failed: the launcher exited with code {code} (its restarts, --max_restart, spent, "
              f"or a worker's error: see the workers' logs in --log_dir){left}", file=sys.stderr)
        return code
    print(f"elastic: job {job} did not finish: the launcher ended without a worker finishing the run{left}.",
          file=sys.stderr)
    return 1


def _finished(folder: Path) -> bool:
    return any(folder.glob("finished-*"))


def mark_finished(unfixable: bool = False) -> None:
    """Called by a worker whose run finished, so that the command above can tell a finished job from a launcher
    that gave up, or (``unfixable``) by one that stopped on an error a restart would meet again (its config, data
    or checkpoint), so that the launcher is not started again for it; nothing outside the command."""
    folder = os.environ.get(FINISHED_VARIABLE)
    if folder and os.path.isdir(folder):
        Path(folder, f"{'unfixable' if unfixable else 'finished'}-{os.getpid()}").touch()


def _problem(master: str | None, job: str, args: list[str]) -> str | None:
    counts = _counts_problem(args)
    if counts:
        return counts
    if not master or not master.startswith("etcd://"):
        return ("needs --master etcd://HOST:PORT: Paddle's launcher restarts nothing without an etcd master "
                "(docs/elastic.md says how to start one)")
    if not job:
        return "needs --job_id NAME: the same name on every node and every start of the job, used by no other job"
    if find_spec("etcd3") is None:
        return "the etcd client is not installed: pip install -e '.[elastic]' (or: pip install etcd3==0.12.0)"
    host, port = _address(master)
    if port is None:
        return f"--master {master} names no port: etcd://HOST:PORT"
    if not _answers(host, port):
        return (f"cannot reach etcd at {host}:{port}: start it (docs/elastic.md) or correct --master; the launcher "
                "would fail there after 16 s")
    return None


def _counts_problem(args: list[str]) -> str | None:
    """What is wrong with the launcher's counts (``--nnodes N`` or ``MIN:MAX``, ``--nproc_per_node``,
    ``--max_restart``), before Paddle's launcher waits forever for no node or fails with a traceback."""
    nnodes = _option(list(args), "--nnodes")
    if nnodes is not None:
        parts = nnodes.split(":")
        if len(parts) > 2 or not all(part.isdigit() for part in parts):
            return f"--nnodes {nnodes!r} must be a node count N or a range MIN:MAX of whole numbers"
        low, high = int(parts[0]), int(parts[-1])
        if low < 1:
            return f"--nnodes {nnodes} must be at least 1 (a job of no node never starts)"
        if low > high:
            return f"--nnodes {nnodes}: the range's minimum {low} is above its maximum {high}"
    for name, least in (("--nproc_per_node", 1), ("--max_restart", 0)):
        value = _option(list(args), name)
        if value is not None and not (value.isdigit() and int(value) >= least):
            return f"{name} {value!r} must be a whole number of at least {least}"
    return None


def _address(master: str) -> tuple[str, int | None]:
    host, _, port = master[len("etcd://"):].split(",")[0].rstrip("/").rpartition(":")
    return (host or "127.0.0.1"), (int(port) if port.isdigit() else None)


def _answers(host: str, port: int, timeout: float = 5.0) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def _split(args: list[str]) -> tuple[list[str], list[str]]:
    """(the launcher's options, the training script and its own arguments): the script is the first ``.py``."""
    script = next((i for i, arg in enumerate(args) if arg.endswith(".py")), len(args))
    return args[:script], args[script:]


def _option(args: list[str], name: str) -> str | None:
    """The value of ``name`` among the launcher's options (before the training script), or None."""
    options, _ = _split(args)
    for i, arg in enumerate(options):
        if arg == name and i + 1 < len(options):
            return options[i + 1]
        if arg.startswith(name + "="):
            return arg[len(name) + 1:]
    return None


def _without(args: list[str], name: str) -> list[str]:
    """``args`` without the launcher's option ``name`` (and its value); the script's own arguments untouched."""
    options, script = _split(args)
    kept, skip = [], False
    for arg in options:
        if skip:
            skip = False
        elif arg == name:
            skip = True
        elif not arg.startswith(name + "="):
            kept.append(arg)
    return kept + script


def _become_subreaper() -> None:
    """Workers orphaned by their launcher become this process's children (Linux), to be waited for."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _wait_for_orphans() -> list[int]:
    """Wait (bounded) for the workers a dead launcher left behind; their exit codes."""
    codes: list[int] = []
    deadline = time.monotonic() + ORPHAN_WAIT_S
    while time.monotonic() < deadline:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid:
            codes.append(os.waitstatus_to_exitcode(status))
        else:
            time.sleep(0.2)
    return codes
