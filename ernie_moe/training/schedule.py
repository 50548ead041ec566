"""Learning-rate schedules: linear warmup, then cosine, linear, constant or warmup-stable-decay.

A checkpoint stores the schedule it followed. A resume whose schedule keys differ (a longer ``max_steps``,
say) re-plans from the resumed step: the rate there is kept and the rest follows the new shape down to
``min_lr`` at the new ``max_steps``, so the rate never jumps. A warm restart
(``training.reset_schedule_on_resume``) instead starts the whole schedule afresh at the resumed step: warmup, then
the decay over the steps left to ``max_steps``.
"""

from __future__ import annotations

import math

from paddle.optimizer.lr import LRScheduler

from ..config.schema import TrainingConfig

KEYS = ("learning_rate", "min_lr", "warmup_steps", "max_steps", "lr_scheduler_type", "wsd_decay_ratio")


def lr_at(step: int, peak: float, min_lr: float, warmup: int, total: int, kind: str, wsd_decay_ratio: float,
          decay_from: int | None = None) -> float:
    """Learning rate for optimizer step ``step`` (0-based). The decay is measured from ``decay_from``
    (default: the end of warmup); a re-planned schedule starts it at the resumed step."""
    if warmup and step < warmup:
        return peak * (step + 1) / warmup
    start = warmup if decay_from is None else decay_from
    if kind == "constant":
        return peak
    if kind == "wsd":
        decay_steps = max(1, int(round(total * wsd_decay_ratio)))
        decay_start = max(start, total - decay_steps)
        if step < decay_start:
            return peak
        progress = min(1.0, (step - decay_start) / max(1, total - decay_start))
        return min_lr + (peak - min_lr) * (1.0 - progress)
    progress = min(1.0, (step - start) / max(1, total - start))
    if kind == "linear":
        return min_lr + (peak - min_lr) * (1.0 - progress)
    return min_lr + (peak - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


def _planned(step: int, args: tuple, anchor, origin: int = 0) -> float:
    if origin:  # a warm restart: the schedule's step 0 is the resumed step, its end max_steps
        peak, min_lr, warmup, total, kind, ratio = args
        return lr_at(step - origin, peak, min_lr, warmup, total - origin, kind, ratio)
    if anchor and step >= anchor[0]:
        _, min_lr, _, total, kind, ratio = args
        return lr_at(step, anchor[1], min_lr, 0, total, kind, ratio, decay_from=anchor[0])
    return lr_at(step, *args)


class WarmupDecay(LRScheduler):
    def __init__(self, training_cfg: TrainingConfig):
        self.args = tuple(getattr(training_cfg, key) for key in KEYS)
        self.anchor: tuple | None = None  # (step, rate) where a resume re-planned the schedule
        self.origin = 0  # the step a warm restart started the schedule afresh at
        super().__init__(learning_rate=training_cfg.learning_rate)

    def get_lr(self) -> float:
        return _planned(max(self.last_epoch, 0), self.args, self.anchor, self.origin)

    def plan(self) -> dict:
        return {**dict(zip(KEYS, self.args)), "anchor": list(self.anchor) if self.anchor else None,
                "origin": self.origin}

    def restart(self, step: int) -> str:
        """A warm restart at ``step``: the schedule from its start, ending at max_steps; returns the log line."""
        self.anchor, self.origin = None, step
        self.last_lr = self.get_lr()
        peak, min_lr, warmup, total, kind, _ = self.args
        return (f"a fresh learning-rate schedule from step {step} (training.reset_schedule_on_resume): {warmup} "
                f"warmup steps to {peak:g}, then {kind} to {min_lr:g} at step {total}")

    def resume(self, saved: dict | None, step: int, warm_restart: bool) -> str | None:
        """After a resume at ``step``: a warm restart when asked for, unless the checkpoint already follows one
        of this schedule (a restarted run resumed again, after a preemption say, continues it); otherwise the
        saved plan, re-planned where the config's differs. Returns what changed, for the log."""
        restarted = saved is not None and bool(saved.get("origin")) and tuple(saved[key] for key in KEYS) == self.args
        if warm_restart and not restarted:
            return self.restart(step)
        return self.continue_plan(saved, step)

    def continue_plan(self, saved: dict | None, step: int) -> str | None:
        """After a resume at ``step``: follow the saved plan, or re-plan when the config's differs; returns
        what changed, for the log (None when nothing did)."""
        if not saved:
            return None
        old_args = tuple(saved[key] for key in KEYS)
        old_anchor = tuple(saved["anchor"]) if saved.get("anchor") else None
        old_origin = saved.get("origin") or 0
        if old_args == self.args:
            self.anchor, self.origin = old_anchor, old_origin
            return None
        rate = _planned(step, old_args, old_anchor, old_origin)
        changed = ", ".join(f"{k} {a} -> {b}" for k, a, b in zip(KEYS, old_args, self.args) if a != b)
        if step >= self.args[2]:
            self.anchor = (step, rate)
            how = (f"the rate continues from {rate:.4g} at step {step} and follows {self.args[4]} to min_lr "
                   f"{self.args[1]:g} at step {self.args[3]}")
        else:
            how = f"the run is inside the warmup, where the new schedule applies (rate {self.get_lr():.4g})"
        self.last_lr = self.get_lr()
        return f"learning-rate schedule changed since the checkpoint ({changed}): {how}"
