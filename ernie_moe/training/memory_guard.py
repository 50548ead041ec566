"""Stepping down when memory runs short, without losing what was trained.

The ladder: recompute at the next granularity (none -> moe -> core_attn -> full_attn -> full), then halve the
micro-batch while doubling gradient accumulation (the global batch and, with token-count normalisation, the
loss stay the same; not under pipeline parallelism, whose schedule fixes its micro-batches). A rung is taken
when a step's allocator peak passes ``training.memory_guard_fraction`` of the device on any rank, or when a
step fails with an out-of-memory error: the step then runs again on the next rung (its gradients are
dropped first; no optimizer step has happened).
"""

from __future__ import annotations

from dataclasses import dataclass

import paddle

from ..model.recompute import GRANULARITIES, apply_recompute

LADDER = (None, "moe", "core_attn", "full_attn", "full")
assert set(LADDER[1:]) == set(GRANULARITIES)


def is_out_of_memory(err: BaseException) -> bool:
    text = str(err)
    return isinstance(err, MemoryError) or "ResourceExhausted" in text or "out of memory" in text.lower()


@dataclass
class Rung:
    message: str  # why, and what changed
    halved: bool  # the micro-batch was halved: the step's rows must be cut again


class MemoryGuard:
    def __init__(self, training_cfg, env, device_bytes: float, model, can_halve: bool):
        self.env, self.model = env, model
        self.limit = training_cfg.memory_guard_fraction * device_bytes
        self.use_reentrant = training_cfg.recompute_use_reentrant
        self.can_halve = can_halve
        self.taken: list[str] = []

    @property
    def enabled(self) -> bool:
        return self.limit > 0

    def over_limit(self, step_peak: float) -> bool:
        """Whether any rank's peak of the step passed the limit (a collective: every rank calls it)."""
        if not self.enabled:
            return False
        peak = paddle.to_tensor([float(step_peak)], dtype="float64")
        if self.env.world_size > 1:
            paddle.distributed.all_reduce(peak, op=paddle.distributed.ReduceOp.MAX)
        return float(peak) > self.limit

    def step_down(self, state, reason: str) -> Rung | None:
        """Take the next rung, changing the training ``state`` (and the model's recompute); None when none is
        left."""
        level = LADDER.index(state.recompute)
        if level + 1 < len(LADDER):
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
