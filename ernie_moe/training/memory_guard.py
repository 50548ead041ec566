"""Stepping down when memory runs short, without losing what was trained.

The ladder: first, with ``training.memory_guard_capacity``, the cheapest lever an MoE has: a tighter training
capacity factor for the routed experts, for ``memory_guard_capacity_steps`` steps (the tokens over it are
dropped, and counted in the expert-balance metrics; the configured capacity returns afterwards, and the rung
can be taken again). Then recompute at the next granularity (none -> moe -> core_attn -> full_attn -> full),
then halve the micro-batch while doubling gradient accumulation (the global batch and, with token-count
normalisation, the loss stay the same; not under pipeline parallelism, whose schedule fixes its
micro-batches). A rung is taken
when the allocator peak of a logging window's steps passes ``training.memory_guard_fraction`` of the device on
any rank (checked at the window's last step, so that other steps need not wait for the ranks), or when a
step fails with an out-of-memory error: the step then runs again on the next rung (its gradients are
dropped first; no optimizer step has happened).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import paddle

from .. import host_reads
from ..config.schema import TrainingConfig
from ..model.recompute import GRANULARITIES, apply_recompute
from ..parallel.env import DistEnv
from ..parallel.pipeline import TrainedModel

LADDER = (None, "moe", "core_attn", "full_attn", "full")
assert set(LADDER[1:]) == set(GRANULARITIES)


def is_out_of_memory(err: BaseException) -> bool:
    text = str(err)
    return isinstance(err, MemoryError) or "ResourceExhausted" in text or "out of memory" in text.lower()


@dataclass
class Rung:
    message: str  # why, and what changed
    halved: bool  # the micro-batch was halved: the step's rows must be cut again


class Attempt:
    """One attempt at a step (:meth:`MemoryGuard.attempts`): ``rows``, this attempt's rows of each micro-batch."""

    def __init__(self, guard: MemoryGuard, state, rows: list | None):
        self.guard, self.state, self.rows = guard, state, rows
        self.rung: Rung | None = None  # taken after an out-of-memory error in it

    def __enter__(self) -> Attempt:
        return self

    def __exit__(self, kind, err, traceback) -> bool:
        if err is None or not is_out_of_memory(err):
            return False
        self.rung = self.guard.step_down(self.state, f"out of memory in step {self.state.step}")
        return self.rung is not None  # swallowed: the step runs again on the next rung


class MemoryGuard:
    def __init__(self, training_cfg: TrainingConfig, env: DistEnv, device_bytes: float, model: TrainedModel,
                 can_halve: bool):
        self.env, self.model = env, model
        self.fraction = training_cfg.memory_guard_fraction
        self.limit = self.fraction * device_bytes
        self.window_peak = 0.0  # the largest step peak of this logging window
        self.use_reentrant = training_cfg.recompute_use_reentrant
        self.can_halve = can_halve
        self.capacity = training_cfg.memory_guard_capacity
        self.capacity_steps = training_cfg.memory_guard_capacity_steps
        self.taken: list[str] = []

    @property
    def enabled(self) -> bool:
        return self.limit > 0

    def attempts(self, state, rows: list | None, rungs: list[Rung], clear: Callable[[], None]) -> Iterator[Attempt]:
        """The attempts at step ``state.step``, each to be run inside its ``with``: an out-of-memory error in one
        takes the next rung (appended to ``rungs``) instead of ending the run, drops its gradients (``clear``) and
        starts another, with each of the step's micro-batches of ``rows`` cut in two where the rung halved the
        micro-batch (``rows`` None: batches given whole); any other error, or one with no rung left, goes on."""
        while True:
            attempt = Attempt(self, state, rows)
            yield attempt
            if attempt.rung is None:
                return
            rungs.append(attempt.rung)
            clear()
            if attempt.rung.halved and rows is not None:
                rows = [half for r in rows for half in (r[: len(r) // 2], r[len(r) // 2:])]

    def after_step(self, state, step_peak: float, ends_window: bool) -> Rung | None:
        """The step's memory peak noted; at a window's end (every rank together), the next rung when the window's
        largest peak on any rank passed the limit, for the steps after it."""
        self.window_peak = max(self.window_peak, step_peak)
        if not ends_window:
            return None
        over, self.window_peak = self.over_limit(self.window_peak), 0.0
        return self.step_down(state, f"step {state.step} passed {self.fraction:.0%} of the device's memory") \
            if over else None

    def over_limit(self, step_peak: float) -> bool:
        """Whether any rank's peak (of the steps since the last check) passed the limit (a collective: every rank
        calls it, at the end of each logging window)."""
        if not self.enabled:
            return False
        if self.env.world_size == 1:
            return step_peak > self.limit
        peak = paddle.to_tensor([float(step_peak)], dtype="float64")
        paddle.distributed.all_reduce(peak, op=paddle.distributed.ReduceOp.MAX)
        return float(host_reads.read(peak, "memory_guard")[0]) > self.limit

    def step_down(self, state, reason: str) -> Rung | None:
        """Take the next rung, changing the training ``state`` (and the model's capacity or recompute); None
        when none is left. The capacity rung, taken in step ``state.step``, holds through the steps after it."""
        level = LADDER.index(state.recompute)
        if self.capacity and state.capacity_until is None:
            state.capacity_until = state.step + self.capacity_steps
            set_training_capacity(self.model, self.capacity)
            change, halved = f"expert capacity {self.capacity:g} until step {state.capacity_until}", False
        elif level + 1 < len(LADDER):
            state.recompute, state.recompute_layers = LADDER[level + 1], 0
            apply_recompute(self.model, state.recompute, state.recompute_layers, self.use_reentrant)
            change, halved = f"recompute {state.recompute}", False
        elif self.can_halve and state.micro_batch_size > 1:
            state.micro_batch_size //= 2
            state.accumulation_steps *= 2
            change, halved = f"micro-batch {state.micro_batch_size} x {state.accumulation_steps} accumulated", True
        else:
            return None
        self.taken.append(f"{reason}: {change}")
        return Rung(self.taken[-1], halved)

    def release(self, state) -> str | None:
        """Before step ``state.step``: the configured capacity returns once the capacity rung's steps are over
        (what changed, or None)."""
        if state.capacity_until is None or state.step <= state.capacity_until:
            return None
        state.capacity_until = None
        set_training_capacity(self.model, None)
        return "the configured expert capacity is back"


def set_training_capacity(model: TrainedModel, factor: float | None) -> None:
    for moe in model.moe_layers():
        moe.training_capacity = factor
