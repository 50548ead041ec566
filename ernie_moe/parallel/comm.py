"""Autograd-aware collectives: native NCCL ops on GPUs, the gloo fallbacks on CPU."""

from __future__ import annotations

import paddle
import paddle.distributed as dist
from paddle.autograd import PyLayer

from . import cpu_fallbacks


def _exchange(x: paddle.Tensor, in_splits: list[int], out_splits: list[int], group) -> paddle.Tensor:
    if dist.get_backend(group) == "GLOO":
        return cpu_fallbacks.all_to_all_single(x, in_splits, out_splits, group)
    out = paddle.empty([sum(out_splits)] + x.shape[1:], dtype=x.dtype)
    dist.alltoall_single(out, x.contiguous(), in_splits, out_splits, group=group)
    return out


class AllToAll(PyLayer):
    """Variable-size all-to-all along dim 0; its backward is the reverse all-to-all."""

    @staticmethod
    def forward(ctx, x, in_splits, out_splits, group):
        ctx.splits, ctx.group = (in_splits, out_splits), group
        return _exchange(x, in_splits, out_splits, group)

    @staticmethod
    def backward(ctx, grad):
        in_splits, out_splits = ctx.splits
        return _exchange(grad, out_splits, in_splits, ctx.group)


def all_to_all(x: paddle.Tensor, in_splits: list[int], out_splits: list[int], group) -> paddle.Tensor:
    return AllToAll.apply(x, in_splits, out_splits, group)
