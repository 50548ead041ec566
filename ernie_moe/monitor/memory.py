"""Memory of this process per logging window: Paddle's GPU allocator, or on a CPU Paddle's host allocator
(every tensor's bytes) and the process RSS."""

from __future__ import annotations

import paddle
import psutil

GB = 1024**3


def on_gpu() -> bool:
    return paddle.is_compiled_with_cuda() and paddle.device.get_device().startswith("gpu")


class MemoryMonitor:
    def __init__(self):
        self.gpu = on_gpu()
        self.process = psutil.Process()
        self.rss_peak = 0
        self.window_peak = 0  # the allocator's peak, kept here because each step restarts the allocator's

    def step_peak(self) -> int:
        """Called after every step: the step's allocator peak in bytes (the window keeps the largest)."""
        if self.gpu:
            peak = paddle.device.cuda.max_memory_allocated()
            paddle.device.cuda.reset_max_memory_allocated()
        else:
            self.rss_peak = max(self.rss_peak, self.process.memory_info().rss)
            peak = paddle.base.core.host_memory_stat_peak_value("Allocated", 0)
            paddle.base.core.host_memory_stat_reset_peak_value("Allocated", 0)
        self.window_peak = max(self.window_peak, peak)
        return peak

    def device_total_gb(self) -> float:
        if self.gpu:
            return paddle.device.cuda.get_device_properties().total_memory / GB
        return psutil.virtual_memory().total / GB

    def pop_window(self) -> dict[str, float]:
        """This window's figures in GB; peaks restart from the current value."""
        if self.gpu:
            cuda = paddle.device.cuda
            figures = {
                "allocated_gb": cuda.memory_allocated() / GB,
                "reserved_gb": cuda.memory_reserved() / GB,
                "max_allocated_gb": max(self.window_peak, cuda.max_memory_allocated()) / GB,
                "max_reserved_gb": cuda.max_memory_reserved() / GB,
            }
            cuda.reset_max_memory_allocated()
            cuda.reset_max_memory_reserved()
            self.window_peak = 0
            return figures
        rss = self.process.memory_info().rss
        core = paddle.base.core
        figures = {"allocated_gb": core.host_memory_stat_current_value("Allocated", 0) / GB,
                   "max_allocated_gb": max(self.window_peak, core.host_memory_stat_peak_value("Allocated", 0)) / GB,
                   "rss_gb": rss / GB, "max_rss_gb": max(self.rss_peak, rss) / GB}
        core.host_memory_stat_reset_peak_value("Allocated", 0)
        self.rss_peak, self.window_peak = rss, 0
        return figures
