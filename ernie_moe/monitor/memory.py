"""Memory of this process per logging window: Paddle's GPU allocator, or the process RSS on a CPU."""

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

    def sample(self) -> None:
        """Called every step on CPU, where no allocator tracks the process's peak for us."""
        if not self.gpu:
            self.rss_peak = max(self.rss_peak, self.process.memory_info().rss)

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
                "max_allocated_gb": cuda.max_memory_allocated() / GB,
                "max_reserved_gb": cuda.max_memory_reserved() / GB,
            }
            cuda.reset_max_memory_allocated()
            cuda.reset_max_memory_reserved()
            return figures
        rss = self.process.memory_info().rss
        figures = {"rss_gb": rss / GB, "max_rss_gb": max(self.rss_peak, rss) / GB}
        self.rss_peak = rss
        return figures
