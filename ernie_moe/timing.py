"""Where a step's time goes: named parts timed by exclusive wall time (a part nested in another, such as a
collective inside the forward pass, is counted once, in the inner part). The trainer times consecutive
phases of the step; the collectives time themselves through :func:`part`, which reports to the
:class:`StepTimes` that is recording (the run's, while its step runs; none elsewhere)."""

from __future__ import annotations

import contextlib
import contextvars
import time
from collections import defaultdict

import paddle

# the parts that are communication
COMMUNICATION = ("tensor_parallel_comm", "expert_all_to_all", "router_stats_comm", "pipeline_send_recv",
                 "gradient_sync", "step_reduce", "weight_gather")


class StepTimes:
    def __init__(self, enabled: bool = True):
        self.wanted = self.enabled = enabled
        self.totals: dict[str, float] = defaultdict(float)
        self._open: list[list] = []  # [name, time spent in parts nested inside it]
        # kernels run asynchronously on GPUs: a part ends when the device has finished its work
        self.synchronizes = paddle.is_compiled_with_cuda()
        self._synchronize = paddle.device.synchronize if self.synchronizes else (lambda: None)

    def sample(self, ends_window: bool) -> None:
        """Before a step: where timing a part makes the host wait for the device (a GPU), only the step that ends a
        logging window is timed; elsewhere every step is."""
        self.enabled = self.wanted and (ends_window or not self.synchronizes)

    @contextlib.contextmanager
    def part(self, name: str):
        if not self.enabled:
            yield
            return
        self._synchronize()
        start = time.perf_counter()
        self._open.append([name, 0.0])
        try:
            yield
        finally:
            self._synchronize()
            elapsed = time.perf_counter() - start
            _, nested = self._open.pop()
            self.totals[name] += elapsed - nested
            if self._open:
                self._open[-1][1] += elapsed

    def pop(self) -> dict[str, float]:
        """The seconds of each part since the last pop."""
        totals, self.totals = dict(self.totals), defaultdict(float)
        return totals

    @contextlib.contextmanager
    def recording(self):
        """Make this the record that :func:`part` reports to, for the ``with`` block."""
        token = _RECORDING.set(self)
        try:
            yield self
        finally:
            _RECORDING.reset(token)


_RECORDING: contextvars.ContextVar[StepTimes | None] = contextvars.ContextVar("step_times", default=None)
_UNTIMED = contextlib.nullcontext()


def part(name: str):
    """Time ``name`` in the record that is recording, if any (collectives deep inside the model call it)."""
    times = _RECORDING.get()
    return times.part(name) if times is not None else _UNTIMED
