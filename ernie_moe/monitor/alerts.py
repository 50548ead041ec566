"""Warnings a person should see in the log: lasting expert imbalance, memory close to the device's size."""

from __future__ import annotations


class Alerts:
    def __init__(self, logging_cfg, device_total_gb: float):
        self.ratio = logging_cfg.imbalance_warn_ratio
        self.windows = logging_cfg.imbalance_warn_windows
        self.memory_fraction = logging_cfg.memory_warn_fraction
        self.device_total_gb = device_total_gb
        self.streaks: dict[str, int] = {}

    def check(self, step: int, scalars: dict, peak_memory_gb: float) -> list[str]:
        """Warning lines for this window (empty when all is well)."""
        lines = []
        for key, value in scalars.items():
            if not key.endswith("/max_mean_load"):
                continue
            streak = self.streaks.get(key, 0) + 1 if value > self.ratio else 0
            self.streaks[key] = streak
            if streak and streak % self.windows == 0:
                layer = key[len("moe/"): -len("/max_mean_load")]
                lines.append(f"step {step}: expert imbalance in {layer}: the busiest expert has {value:.2f}x the mean "
                             f"load for {streak} logging windows (threshold {self.ratio:.2f})")
        if self.device_total_gb and peak_memory_gb > self.memory_fraction * self.device_total_gb:
            lines.append(f"step {step}: memory {peak_memory_gb:.1f} GB is above {self.memory_fraction:.0%} of the "
                         f"device's {self.device_total_gb:.1f} GB")
        return lines
