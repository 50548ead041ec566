"""Learning-rate schedules: linear warmup, then cosine, linear, constant or warmup-stable-decay."""

from __future__ import annotations

import math

from paddle.optimizer.lr import LRScheduler


def lr_at(step: int, peak: float, min_lr: float, warmup: int, total: int, kind: str, wsd_decay_ratio: float) -> float:
    """Learning rate for optimizer step ``step`` (0-based)."""
    if warmup and step < warmup:
        return peak * (step + 1) / warmup
    if kind == "constant":
        return peak
    if kind == "wsd":
        decay_steps = max(1, int(round(total * wsd_decay_ratio)))
        decay_start = max(warmup, total - decay_steps)
        if step < decay_start:
            return peak
        progress = min(1.0, (step - decay_start) / max(1, total - decay_start))
        return min_lr + (peak - min_lr) * (1.0 - progress)
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    if kind == "linear":
        return min_lr + (peak - min_lr) * (1.0 - progress)
    return min_lr + (peak - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


class WarmupDecay(LRScheduler):
    def __init__(self, training_cfg):
        t = training_cfg
        self.args = (t.learning_rate, t.min_lr, t.warmup_steps, t.max_steps, t.lr_scheduler_type, t.wsd_decay_ratio)
        super().__init__(learning_rate=t.learning_rate)

    def get_lr(self) -> float:
        return lr_at(max(self.last_epoch, 0), *self.args)
