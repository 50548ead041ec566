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

from ..model.recompute import GRANULARITIES, configure_recompute

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
    def __init__(self, cfg, env, device_bytes: float, layers, vision_models):
        self.cfg, self.env = cfg, env
        self.limit = cfg.training.memory_guard_fraction * device_bytes
        self.layers, self.vision_models = layers, vision_models
        self.can_halve = env.pp_group is None
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

    def step_down(self, reason: str) -> Rung | None:
        """Take the next rung; None when none is left."""
        t = self.cfg.training
        level = LADDER.index(t.recompute_granularity if t.recompute else None)
        if level + 1 < len(LADDER):
            t.recompute, t.recompute_granularity, t.recompute_layers = True, LADDER[level + 1], 0
            configure_recompute(self.layers, t, self.cfg.model.num_hidden_layers, self.vision_models)
            change, halved = f"recompute {t.recompute_granularity}", False
        elif self.can_halve and t.per_device_train_batch_size > 1:
            t.per_device_train_batch_size //= 2
            t.gradient_accumulation_steps *= 2
            change, halved = (f"micro-batch {t.per_device_train_batch_size} x {t.gradient_accumulation_steps} "
                              "accumulated"), True
        else:
            return None
        self.taken.append(f"{reason}: {change}")
        return Rung(self.taken[-1], halved)
