"""Stopping cleanly when a job is told to: SIGTERM (a scheduler's preemption, before its SIGKILL), SIGINT, or the
launcher gone (a worker whose parent died would otherwise train on beside a restarted job).

A handler only notes the request; at the end of each step every rank says whether it has one (one small
all-reduce), so all ranks stop after the same step, save a checkpoint and exit with :data:`EXIT_CODE`.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import paddle
import paddle.distributed as dist

from ..parallel.env import DistEnv

EXIT_CODE = 4  # stopped on request, checkpoint saved: resume with training.resume_from_checkpoint=auto
SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopRequested(Exception):
    """The run stopped after a step, on request, with a checkpoint of that step."""


class StopWatch:
    """Notes SIGTERM / SIGINT and a change of parent process while installed (``with StopWatch(env): ...``)."""

    def __init__(self, env: DistEnv, enabled: bool = True):
        self.env, self.enabled = env, enabled
        self.reason: str | None = None
        self.parent = os.getppid()
        self._previous: dict = {}

    def __enter__(self):
        if self.enabled and threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._note)
        return self

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}
        return False

    def _note(self, signum, frame) -> None:
        self.reason = self.reason or f"{signal.Signals(signum).name} received"

    def hold(self, released, limit_s: float = 600.0) -> None:
        """Wait until told to stop, the launcher is gone or ``released()`` (the fault ``hold_in_step``), at most
        ``limit_s``; in short sleeps, so that a signal's handler runs."""
        deadline = time.monotonic() + limit_s
        while self.reason is None and os.getppid() == self.parent and not released() and time.monotonic() < deadline:
            time.sleep(0.1)

    def agreed(self) -> str | None:
        """Why the run stops after this step (on every rank alike), or None. Called by every rank each step."""
        if not self.enabled:
            return None
        self._check_parent()
        if self.env.world_size == 1:
            return self.reason
        flag = paddle.to_tensor([1.0 if self.reason else 0.0])
        dist.all_reduce(flag)  # over every rank of the job
        if float(flag) == 0:
            return None
        # another rank may have seen a launcher this one shares die after this one looked: it is gone by now
        self._check_parent()
        return self.reason or "another rank was told to stop"

    def _check_parent(self) -> None:
        if self.reason is None and os.getppid() != self.parent:
            self.reason = "the process that started this one is gone"
