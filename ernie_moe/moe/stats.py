"""Per-layer routing counters, accumulated on the device and read once per logging window."""

from __future__ import annotations

import paddle

LOSS_NAMES = ("aux_loss", "z_loss", "orthogonal_loss")


class ExpertStats:
    def __init__(self, group_sizes: list[int]):
        self.group_sizes = group_sizes
        self.enabled = True  # window counters; the usage count for the correction bias is always kept
        total = sum(group_sizes)
        self.routed = paddle.zeros([total], dtype="int64")  # copies sent to each expert before capacity
        self.kept = paddle.zeros([total], dtype="int64")  # copies each expert processed
        self.usage = paddle.zeros([total], dtype="int64")  # routed since the last correction-bias update
        self.loss_sums = paddle.zeros([len(group_sizes), len(LOSS_NAMES)], dtype="float32")
        self.loss_counts = paddle.zeros([len(group_sizes)], dtype="float32")

    @paddle.no_grad()
    def record_routing(self, routed: paddle.Tensor, kept: paddle.Tensor) -> None:
        self.usage += routed
        if self.enabled:
            self.routed += routed
            self.kept += kept

    @paddle.no_grad()
    def record_losses(self, group: int, losses: dict[str, paddle.Tensor]) -> None:
        if not self.enabled:
            return
        values = paddle.stack([losses[name].detach().astype("float32") for name in LOSS_NAMES])
        self.loss_sums[group] = self.loss_sums[group] + values
        self.loss_counts[group] = self.loss_counts[group] + 1.0

    def all_reduce(self, reduce_sum) -> None:
        """Sum the window counters over the ranks that saw different tokens."""
        for tensor in (self.routed, self.kept, self.loss_sums, self.loss_counts):
            reduce_sum(tensor)

    def pop_usage(self) -> paddle.Tensor:
        usage, self.usage = self.usage, paddle.zeros_like(self.usage)
        return usage

    def pop_window(self) -> dict:
        """Counters since the last call, as numpy arrays; resets them."""
        window = {
            "routed": self.routed.numpy(),
            "kept": self.kept.numpy(),
            "loss_sums": self.loss_sums.numpy(),
            "loss_counts": self.loss_counts.numpy(),
        }
        self.routed = paddle.zeros_like(self.routed)
        self.kept = paddle.zeros_like(self.kept)
        self.loss_sums = paddle.zeros_like(self.loss_sums)
        self.loss_counts = paddle.zeros_like(self.loss_counts)
        return window
