"""Autograd-aware collectives: native NCCL ops on GPUs, the gloo fallbacks on CPU."""

from __future__ import annotations

import paddle
import paddle.distributed as dist
from paddle.autograd import PyLayer

from ..timing import part
from . import cpu_fallbacks


def _exchange(x: paddle.Tensor, in_splits: list[int], out_splits: list[int], group) -> paddle.Tensor:
    with part("expert_all_to_all"):
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


# ---------------------------------------------------------------- tensor-parallel regions (Megatron's f and g)
def _all_reduce(x: paddle.Tensor, group, timed_as: str = "tensor_parallel_comm") -> paddle.Tensor:
    with part(timed_as):
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out


def _all_gather(x: paddle.Tensor, axis: int, group) -> paddle.Tensor:
    with part("tensor_parallel_comm"):
        parts: list[paddle.Tensor] = []
        dist.all_gather(parts, x.contiguous(), group=group)
        return paddle.concat(parts, axis=axis)


def _own_chunk(x: paddle.Tensor, axis: int, group) -> paddle.Tensor:
    return paddle.split(x, group.nranks, axis=axis)[group.rank].contiguous()


def _reduce_scatter(x: paddle.Tensor, axis: int, group) -> paddle.Tensor:
    with part("tensor_parallel_comm"):
        if dist.get_backend(group) == "GLOO":
            return cpu_fallbacks.reduce_scatter(x, axis, group)
        chunks = [c.contiguous() for c in paddle.split(x, group.nranks, axis=axis)]
        out = paddle.empty_like(chunks[group.rank])
        dist.reduce_scatter(out, chunks, group=group)
        return out


class CopyToGroup(PyLayer):
    """Identity forward; backward sums the gradients of the ranks (the input of a column-parallel layer)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group)


class ReduceFromGroup(PyLayer):
    """Sum over the ranks forward (the output of a row-parallel layer); identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad.clone()


class SumOverRanks(PyLayer):
    """Sum of a statistic over ranks that hold other tokens; every rank then computes the same global loss.

    Backward scales by the number of ranks: each rank's gradient covers only its own share, and the data-parallel
    average that follows divides by that number again.
    """

    @staticmethod
    def forward(ctx, x, group):
        ctx.ranks = group.nranks
        return _all_reduce(x, group, timed_as="router_stats_comm")

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.ranks


class GatherAlong(PyLayer):
    """Concatenate the ranks' pieces along ``axis``. Backward: ``reduce_grad`` sums the ranks' gradients
    and keeps this rank's piece (the consumer is split over the ranks); otherwise each rank already holds
    the whole gradient and keeps its piece."""

    @staticmethod
    def forward(ctx, x, axis, group, reduce_grad):
        ctx.args = (axis, group, reduce_grad)
        return _all_gather(x, axis, group)

    @staticmethod
    def backward(ctx, grad):
        axis, group, reduce_grad = ctx.args
        return _reduce_scatter(grad, axis, group) if reduce_grad else _own_chunk(grad, axis, group)


class SplitAlong(PyLayer):
    """Keep this rank's piece along ``axis``, of the sum over the ranks when ``summed`` (a reduce-scatter);
    backward gathers the pieces."""

    @staticmethod
    def forward(ctx, x, axis, group, summed=False):
        ctx.args = (axis, group)
        return _reduce_scatter(x, axis, group) if summed else _own_chunk(x, axis, group)

    @staticmethod
    def backward(ctx, grad):
        axis, group = ctx.args
        return _all_gather(grad, axis, group)


class GatherRows(PyLayer):
    """Concatenate the ranks' row blocks of different lengths (``sizes[r]`` rows from rank r).

    Every rank consumes the whole result identically, so backward keeps this rank's block of the gradient.
    """

    @staticmethod
    def forward(ctx, x, sizes, group):
        ctx.args = (sizes, group)
        longest = max(max(sizes), 1)
        padded = paddle.zeros([longest] + x.shape[1:], dtype=x.dtype)
        if x.shape[0]:
            padded[: x.shape[0]] = x
        parts: list[paddle.Tensor] = []
        dist.all_gather(parts, padded, group=group)
        return paddle.concat([p[:n] for p, n in zip(parts, sizes)], axis=0)

    @staticmethod
    def backward(ctx, grad):
        sizes, group = ctx.args
        start = sum(sizes[: group.rank])
        return grad[start: start + sizes[group.rank]].clone()
