"""Tensor-parallel layers (Megatron-style) over a tensor-parallel group, with optional sequence parallelism.

Weights are slices of the tensor a single device would have drawn (``nn.init`` draws by name), so any
layout starts from the same model. Each split parameter's record (``nn.param_spec``) says how it is split (the
fused pieces, such as q/k/v or gate/up, each split evenly; see ``nn.sharding``), which is how the exporter and
gradient clipping put it back together.
"""

from __future__ import annotations

import paddle
import paddle.distributed as dist
from paddle import nn

from ..batch import IGNORE_INDEX
from ..nn.sharding import sharded_parameter
from .comm import CopyToGroup, GatherAlong, ReduceFromGroup, SplitAlong

SEQUENCE_AXIS = 1  # activations are [batch, seq, hidden]


def enter_region(x: paddle.Tensor, group, sequence_parallel: bool) -> paddle.Tensor:
    """Input of a column-parallel layer: whole on every rank (gathered from the sequence pieces under SP)."""
    if sequence_parallel:
        return GatherAlong.apply(x, SEQUENCE_AXIS, group, True)
    return CopyToGroup.apply(x, group)


def leave_region(x: paddle.Tensor, group, sequence_parallel: bool) -> paddle.Tensor:
    """Output of a row-parallel layer: partial sums added up (and split along the sequence under SP)."""
    if sequence_parallel:
        return SplitAlong.apply(x, SEQUENCE_AXIS, group, True)
    return ReduceFromGroup.apply(x, group)


class ColumnParallelLinear(nn.Layer):
    """``y[:, own columns] = x W[:, own columns]``; the output stays split over the ranks."""

    def __init__(self, in_features: int, out_features: int, group, sequence_parallel: bool, std: float,
                 segments: list[int] | None = None):
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        self.weight = sharded_parameter(self, [in_features, out_features], 1, segments or [out_features], group, std)

    def forward(self, x):
        return paddle.matmul(enter_region(x, self.group, self.sequence_parallel), self.weight)


class RowParallelLinear(nn.Layer):
    """``y = sum over ranks of x[:, own rows] W[own rows, :]``; the input arrives split over the ranks."""

    def __init__(self, in_features: int, out_features: int, group, sequence_parallel: bool, std: float):
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        self.weight = sharded_parameter(self, [in_features, out_features], 0, [in_features], group, std)

    def forward(self, x):
        return leave_region(paddle.matmul(x, self.weight), self.group, self.sequence_parallel)


class VocabParallelEmbedding(nn.Layer):
    """Each rank holds a block of vocabulary rows; ids outside it look up zeros and the ranks' rows are summed."""

    def __init__(self, num_embeddings: int, dim: int, group, std: float):
        super().__init__()
        self.group = group
        self.weight = sharded_parameter(self, [num_embeddings, dim], 0, [num_embeddings], group, std)
        self.start = group.rank * self.weight.shape[0]

    def forward(self, ids):
        local = ids - self.start
        inside = paddle.logical_and(local >= 0, local < self.weight.shape[0])
        rows = nn.functional.embedding(paddle.where(inside, local, paddle.zeros_like(local)), self.weight)
        rows = rows * inside.unsqueeze(-1).astype(rows.dtype)
        return ReduceFromGroup.apply(rows, self.group)


def vocab_parallel_cross_entropy_sum(logits: paddle.Tensor, labels: paddle.Tensor, group) -> paddle.Tensor:
    """Summed cross-entropy from logits split over the vocabulary; never forms the full logits."""
    return vocab_parallel_cross_entropy(logits, labels, group).sum()


def vocab_parallel_cross_entropy(logits: paddle.Tensor, labels: paddle.Tensor, group) -> paddle.Tensor:
    """Each position's cross-entropy from logits split over the vocabulary, 0 where the label is IGNORE_INDEX.

    ``logits [..., vocab / ranks]`` hold this rank's vocabulary block; label IGNORE_INDEX marks positions without loss.
    """
    logits = logits.astype("float32")
    block = logits.shape[-1]
    peak = logits.max(axis=-1, keepdim=True).detach()
    dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)  # a constant shift: no gradient needed
    shifted = logits - peak
    sum_exp = ReduceFromGroup.apply(paddle.exp(shifted).sum(axis=-1), group)
    local = labels - group.rank * block
    inside = paddle.logical_and(local >= 0, local < block)
    picked = paddle.take_along_axis(shifted, paddle.where(inside, local, paddle.zeros_like(local)).unsqueeze(-1),
                                    axis=-1).squeeze(-1)
    picked = ReduceFromGroup.apply(picked * inside.astype("float32"), group)
    per_token = paddle.log(sum_exp) - picked
    return per_token * (labels != IGNORE_INDEX).astype("float32")


@paddle.no_grad()
def vocab_parallel_argmax(logits: paddle.Tensor, group) -> paddle.Tensor:
    """argmax over the whole vocabulary from logits split over it (ties go to the lowest id, as argmax does)."""
    block = logits.shape[-1]
    best = logits.max(axis=-1).astype("float32")
    where = logits.argmax(axis=-1) + group.rank * block
    bests: list[paddle.Tensor] = []
    wheres: list[paddle.Tensor] = []
    dist.all_gather(bests, best, group=group)
    dist.all_gather(wheres, where, group=group)
    owner = paddle.stack(bests, axis=-1).argmax(axis=-1, keepdim=True)
    return paddle.take_along_axis(paddle.stack(wheres, axis=-1), owner, axis=-1).squeeze(-1)
