"""Device-to-host reads in training steps: each one makes the host wait until the device has finished the work
queued before it, so the device then idles while the host queues the next kernels.

A training step reads nothing back except what it cannot do without, each such read named in :data:`DECLARED`
and made through :func:`read`. Losses, token counts, gradient norms and router statistics stay on the device
and are read once per logging window (``training.state.read_results``).

:class:`HostReadCounter` counts the declared reads by name and catches every other read of a tensor's value
(``numpy``, ``item``, ``tolist``, ``float``, ``int``, ``bool``, ``index``), named by the line that made it:
``logging.count_host_reads`` counts the reads of a run's steps into its summary, and
``benchmarks/bench_train.py --profile`` prints them.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections import Counter
from pathlib import Path
from types import FrameType

import numpy as np
import paddle

# the reads a step cannot do without, and why
DECLARED = {
    "finite_check": "whether the step's gradients are finite, so that the optimizer steps or skips: once a step",
    "expert_rows": "each expert's row count in a dropless MoE layer, which splits the rows between the experts' "
                   "matmuls (and sizes an all-to-all): once per MoE layer and micro-batch, again where a "
                   "recompute repeats the layer",
    "cpu_all_to_all": "the CPU backend's all-to-all, made of all-gathers, learns every rank's row counts (on GPUs "
                      "NCCL's all-to-all needs no read)",
    "memory_guard": "at the end of a logging window, whether any rank's memory peak passed the memory guard's limit "
                    "(a maximum over the ranks; a single process compares on the host)",
    "host_inputs": "a tensor made on the host and kept there (the images' grid, which plans the vision blocks' "
                   "work): no wait for the device",
    "decoding": "sampling answers (training.stage: grpo, in the steps that start a rollout): each new token's "
                "logits for the host's sampler, once per new token, and the routing each forward recorded",
    "nonfinite": "on a step skipped for inf/nan gradients, which of this rank's gradients held them, to name the "
                 "layers: one read for all of them, on such steps only",
    "rollout": "whether any data rank still misses groups after a round of prompts: once per round of a rollout; "
               "with router_replay old_policy, the old policy's log-probabilities and routes, once per micro-batch "
               "and MoE layer of a rollout; the rollouts' figures and the window's largest sampler-trainer ratio, once "
               "per logging window",
}
TENSOR_READS = ("numpy", "item", "tolist", "__float__", "__int__", "__bool__", "__index__")
_PADDLE = str(Path(paddle.__file__).parent / "base")  # paddle's own tensor plumbing, which a read passes through
_THIS = __file__

_active: HostReadCounter | None = None


def read(tensor: paddle.Tensor, reason: str) -> np.ndarray:
    """``tensor``'s value on the host, for a reason in :data:`DECLARED`."""
    if _active is None:
        return tensor.numpy()
    _active.declared[reason] += 1
    with _active.quiet():
        return tensor.numpy()


class HostReadCounter:
    """Counts reads while :meth:`counting`; ``declared``: by reason, ``undeclared``: by ``file:line method``."""

    def __init__(self):
        self.declared: Counter = Counter()
        self.undeclared: Counter = Counter()
        self._local = threading.local()
        self._originals = {}

    @contextlib.contextmanager
    def counting(self):
        global _active
        if _active is not None:
            raise RuntimeError("host reads are already being counted")
        self._patch()
        _active = self
        try:
            yield self
        finally:
            _active = None
            self._unpatch()

    @contextlib.contextmanager
    def quiet(self):
        self._local.depth = getattr(self._local, "depth", 0) + 1
        try:
            yield
        finally:
            self._local.depth -= 1

    def total(self) -> dict:
        return {"declared": dict(self.declared), "undeclared": dict(self.undeclared)}

    def _patch(self) -> None:
        for name in TENSOR_READS:
            original = getattr(paddle.Tensor, name)
            self._originals[name] = original
            setattr(paddle.Tensor, name, self._counted(name, original))

    def _unpatch(self) -> None:
        for name, original in self._originals.items():
            setattr(paddle.Tensor, name, original)
        self._originals = {}

    def _counted(self, name: str, original):
        counter = self

        def counted(tensor, *args, **kwargs):
            if getattr(counter._local, "depth", 0):
                return original(tensor, *args, **kwargs)
            counter.undeclared[f"{_caller()} {name}"] += 1
            with counter.quiet():  # one read, however many of these methods it passes through
                return original(tensor, *args, **kwargs)

        return counted


def _caller() -> str:
    """``file:line`` of the innermost frame outside paddle's tensor plumbing and this module."""
    frame: FrameType | None = sys._getframe(2)
    while frame is not None and (frame.f_code.co_filename.startswith(_PADDLE) or frame.f_code.co_filename == _THIS):
        frame = frame.f_back
    if frame is None:
        return "?"
    path = frame.f_code.co_filename
    for root in ("ernie_moe/", "paddle/", "tests/", "benchmarks/"):
        if root in path:
            path = root + path.rsplit(root, 1)[1]
            break
    return f"{path}:{frame.f_lineno}"
