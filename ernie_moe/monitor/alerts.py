"""Warnings a person should see in the log: lasting expert imbalance, memory close to the device's size, rollouts
whose groups give the policy no gradient.

Each condition is said once when it begins and once when it ends, not every window while it lasts: a long run
with one imbalanced layer gets two lines about it, not one per window.
"""

from __future__ import annotations


class Alerts:
    def __init__(self, logging_cfg, device_total_gb: float):
        self.ratio = logging_cfg.imbalance_warn_ratio
        self.windows = logging_cfg.imbalance_warn_windows
        self.memory_fraction = logging_cfg.memory_warn_fraction
        self.device_total_gb = device_total_gb
        self.streaks: dict[str, int] = {}
        self.memory_high = False
        self.equal_rewards = False

    def check(self, step: int, scalars: dict, peak_memory_gb: float) -> list[str]:
        """Warning lines for this window: conditions that began or ended in it (empty when nothing changed)."""
        lines = []
        for key, value in scalars.items():
            if not key.endswith("/max_mean_load"):
                continue
            layer = key[len("moe/"): -len("/max_mean_load")]
            before = self.streaks.get(key, 0)
            streak = before + 1 if value > self.ratio else 0
            self.streaks[key] = streak
            if streak == self.windows:
                lines.append(f"step {step}: expert imbalance in {layer}: the busiest expert has {value:.2f}x the mean "
                             f"load for {streak} logging windows (threshold {self.ratio:.2f}); said again when it "
                             "ends")
            elif before >= self.windows and not streak:
                lines.append(f"step {step}: {layer} is balanced again (the busiest expert at {value:.2f}x the mean "
                             f"load, after {before} windows above {self.ratio:.2f})")
        limit = self.memory_fraction * self.device_total_gb
        high = bool(self.device_total_gb) and peak_memory_gb > limit
        if high and not self.memory_high:
            lines.append(f"step {step}: memory {peak_memory_gb:.1f} GB is above {self.memory_fraction:.0%} of the "
                         f"device's {self.device_total_gb:.1f} GB; said again when it falls below")
        elif self.memory_high and not high:
            lines.append(f"step {step}: memory {peak_memory_gb:.1f} GB is below {self.memory_fraction:.0%} of the "
                         "device's again")
        self.memory_high = high
        lines += self._equal_rewards(step, scalars)
        return lines

    def _equal_rewards(self, step: int, scalars: dict) -> list[str]:
        """Most of a window's rollout groups scored all their answers alike: they carry no advantage, so no
        gradient; said when it begins and when it ends."""
        share = scalars.get("rollout/equal_reward_groups")
        if share is None:
            return []
        equal, reward = share >= EQUAL_REWARD_SHARE, scalars.get("rollout/reward", 0.0)
        lines = []
        if equal and not self.equal_rewards:
            if reward <= 0.5:
                advice = ("the answers mostly score low: the task is too hard for the model as it is (fine-tune it "
                          "first, or give partial credit, as word_accuracy does)")
            else:
                advice = "the answers mostly score high: give harder prompts, or a stricter reward"
            lines.append(f"step {step}: {share:.0%} of the rollout groups scored every answer alike (mean reward "
                         f"{reward:.3f}), so they give the policy no gradient; {advice}. "
                         "training.rl.dynamic_sampling=true samples other prompts in their place. Said again when it "
                         "ends")
        elif self.equal_rewards and not equal:
            lines.append(f"step {step}: {share:.0%} of the rollout groups scored their answers alike, fewer than "
                         f"{EQUAL_REWARD_SHARE:.0%} again")
        self.equal_rewards = equal
        return lines


EQUAL_REWARD_SHARE = 0.5  # "most" of a window's groups
