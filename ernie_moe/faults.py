"""Faults injected on purpose, for the tests that prove what a checkpoint survives.

``ERNIE_MOE_FAULT=<point>@<step>[@<rank>]`` makes the save of ``step`` (on every rank, or on ``rank`` alone)
fail at ``point``:

- ``kill_during_save``: SIGKILL once the model files are written, before the optimizer state;
- ``kill_during_background_write``: SIGKILL on the writer's thread of a save written in the background
  (``training.async_save``), once it has written the model files, while training goes on;
- ``kill_before_rename``: SIGKILL with the completion marker written but the folder not yet renamed;
- ``disk_full``: the optimizer writer raises ``ENOSPC`` (No space left on device);
- ``sigterm_during_save``: SIGTERM once the model files are written, as a scheduler's preemption would;
- ``sigterm_in_step``: SIGTERM after the step's forward and backward passes (the trainer's hook);
- ``launcher_killed``: at the same point, SIGKILL to the process that started this one (the launcher);
- ``kill_worker`` / ``kill_every_worker``: a data worker (``data.num_workers``) asked for sample ``<step>`` kills
  itself with SIGKILL, the first worker only or every worker that takes the sample;
- ``perturb_weight``: after the optimizer step ``<step>``, the first element of the first replicated parameter
  moves by 1e-3 (on ``rank`` only, for the replica check to find);
- ``kill_in_step``: SIGKILL after the step's forward and backward passes (a worker lost mid-run);
- ``node_lost``: at the same point, SIGKILL to the launcher and then to this process (a node gone, when the
  launcher has this one worker);
- ``hold_in_step``: at the same point, wait until the run is told to stop, its launcher is gone or the file
  ``release`` appears in the ``ERNIE_MOE_FAULT_ONCE`` folder (a run held while a test acts around it).

Several faults: comma-separated. ``ERNIE_MOE_FAULT_ONCE=<folder>``: each fault strikes once in all the processes
and restarts of a job (the first to create ``<folder>/<point>`` strikes), so a restarted job does not meet it
again. Unset, :func:`hit` is one dictionary look-up.
"""

from __future__ import annotations

import errno
import os
import signal

VARIABLE = "ERNIE_MOE_FAULT"
ONCE_VARIABLE = "ERNIE_MOE_FAULT_ONCE"


def at(point: str, step: int, rank: int) -> bool:
    """Whether the fault ``point`` strikes ``step`` on ``rank``."""
    spec = os.environ.get(VARIABLE)
    if not spec:
        return False
    for one in spec.split(","):
        name, _, where = one.strip().partition("@")
        at_step, _, at_rank = where.partition("@")
        if name == point and at_step == str(step) and (not at_rank or at_rank == str(rank)):
            return _first_strike(point)
    return False


def _first_strike(point: str) -> bool:
    once = os.environ.get(ONCE_VARIABLE)
    if not once:
        return True
    try:
        os.close(os.open(os.path.join(once, point), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:
        return False


def released() -> bool:
    """Whether a test let a held run go on (``hold_in_step``)."""
    once = os.environ.get(ONCE_VARIABLE)
    return once is not None and os.path.exists(os.path.join(once, "release"))


def hit(point: str, step: int, rank: int) -> None:
    if not at(point, step, rank):
        return
    if point.startswith("kill"):
        os.kill(os.getpid(), signal.SIGKILL)
    if point.startswith("sigterm"):
        os.kill(os.getpid(), signal.SIGTERM)
    if point in ("launcher_killed", "node_lost"):
        os.kill(os.getppid(), signal.SIGKILL)
    if point == "node_lost":
        os.kill(os.getpid(), signal.SIGKILL)
    if point == "disk_full":
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), f"optimizer-{rank:05d}.safetensors")
