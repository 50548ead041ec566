"""The one place that decides which linear, embedding, norm, loss and expert-dispatch pieces the model uses.

The model asks a plan for its parallelisable pieces and never checks how many processes exist.
``SingleDevicePlan`` hands out the plain Paddle layers and keeps every expert local; ``ParallelPlan`` hands
out tensor-parallel layers (optionally sequence-parallel) and keeps a share of the experts, reached by
all-to-all over an expert group (``moe_group: ep``) or gathered over the tensor-parallel ranks (``mp``).
"""

from __future__ import annotations

import copy

import paddle
from paddle import nn

from ..batch import IGNORE_INDEX
from ..model.init import mark_normal
from ..model.layers import RMSNorm
from ..moe.dispatcher import LocalDispatcher
from . import tensor_parallel as tp
from .comm import GatherAlong, SplitAlong, SumOverRanks
from .expert_parallel import ExpertParallelDispatcher, TensorParallelExpertDispatcher, local_expert_ids

_ZERO = paddle.ParamAttr(initializer=nn.initializer.Constant(0.0))


class SingleDevicePlan:
    def __init__(self, initializer_range: float = 0.02):
        self.std = initializer_range

    def local(self) -> SingleDevicePlan:
        """Plain local layers, for pieces no layout splits (routed experts)."""
        return SingleDevicePlan(self.std)

    def full_sequence(self) -> SingleDevicePlan:
        """The plan for a block that sees the whole sequence (the MoE block under sequence parallelism)."""
        return self

    def linear(self, in_features: int, out_features: int) -> nn.Linear:
        layer = nn.Linear(in_features, out_features, weight_attr=_ZERO, bias_attr=False)
        mark_normal(layer.weight, self.std)  # drawn by name once the model is built (model.init)
        return layer

    # Megatron's names: column-parallel layers split their output features (``segments``: fused pieces such
    # as q/k/v, each split on its own), row-parallel ones their input features.
    def column_linear(self, in_features: int, out_features: int, segments: list[int] | None = None) -> nn.Layer:
        return self.linear(in_features, out_features)

    def row_linear(self, in_features: int, out_features: int) -> nn.Layer:
        return self.linear(in_features, out_features)

    def embedding(self, num_embeddings: int, dim: int) -> nn.Layer:
        layer = nn.Embedding(num_embeddings, dim, weight_attr=_ZERO)
        mark_normal(layer.weight, self.std)
        return layer

    def norm(self, dim: int, eps: float) -> RMSNorm:
        return RMSNorm(dim, eps)

    def split_sequence(self, x: paddle.Tensor) -> paddle.Tensor:
        """Whole-sequence activations -> this rank's piece (identity without sequence parallelism)."""
        return x

    def gather_sequence(self, x: paddle.Tensor) -> paddle.Tensor:
        """This rank's piece -> the whole sequence, for a block every rank computes in full."""
        return x

    def tied_head(self, hidden: paddle.Tensor, embedding_weight: paddle.Tensor) -> paddle.Tensor:
        return paddle.matmul(hidden, embedding_weight, transpose_y=True)

    def router_stats_reduce(self):
        """How router losses sum token statistics over ranks with other tokens; None: each rank's own tokens."""
        return None

    def local_expert_ids(self, expert_counts: list[int]) -> list[int]:
        """Global ids of the routed experts this process holds."""
        return list(range(sum(expert_counts)))

    def dispatcher(self, expert_counts: list[int], renormalize_kept: bool = False) -> LocalDispatcher:
        return LocalDispatcher(renormalize_kept)

    def predict(self, logits: paddle.Tensor) -> paddle.Tensor:
        """The most likely token id at each position."""
        return logits.argmax(axis=-1)

    def cross_entropy_sum(self, logits: paddle.Tensor, labels: paddle.Tensor) -> paddle.Tensor:
        """Summed token cross-entropy in float32; label IGNORE_INDEX marks positions without a loss."""
        logits = logits.astype("float32")
        loss = paddle.nn.functional.cross_entropy(logits, labels.unsqueeze(-1), ignore_index=IGNORE_INDEX,
                                                  reduction="sum")
        # Paddle's CPU kernel turns nan logits into a finite loss; this keeps a non-finite logit visible in the loss
        return loss + logits.detach().sum() * 0.0


class ParallelPlan(SingleDevicePlan):
    """Tensor-parallel layers over ``tp_group`` (None: plain layers) and routed experts split over
    ``expert_group`` (None: all local). ``experts_on_tp_ranks``: the expert group is the tensor-parallel
    group, whose ranks see the same tokens (``moe_group: mp``)."""

    def __init__(self, initializer_range: float, tp_group=None, sequence_parallel: bool = False,
                 expert_group=None, experts_on_tp_ranks: bool = False, router_stats_group=None):
        super().__init__(initializer_range)
        self.router_stats_group = router_stats_group
        self.tp_group, self.sequence_parallel = tp_group, sequence_parallel
        self.expert_group, self.experts_on_tp_ranks = expert_group, experts_on_tp_ranks

    def full_sequence(self) -> ParallelPlan:
        plan = copy.copy(self)
        plan.sequence_parallel = False
        return plan

    def column_linear(self, in_features, out_features, segments=None):
        if self.tp_group is None:
            return super().column_linear(in_features, out_features, segments)
        return tp.ColumnParallelLinear(in_features, out_features, self.tp_group, self.sequence_parallel, self.std,
                                       segments)

    def row_linear(self, in_features, out_features):
        if self.tp_group is None:
            return super().row_linear(in_features, out_features)
        return tp.RowParallelLinear(in_features, out_features, self.tp_group, self.sequence_parallel, self.std)

    def embedding(self, num_embeddings, dim):
        if self.tp_group is None:
            return super().embedding(num_embeddings, dim)
        return tp.VocabParallelEmbedding(num_embeddings, dim, self.tp_group, self.std)

    def norm(self, dim, eps):
        norm = RMSNorm(dim, eps)
        # Under sequence parallelism each rank sees part of the tokens: its gradient is partial.
        norm.weight.sequence_parallel = self.sequence_parallel
        return norm

    def split_sequence(self, x):
        return SplitAlong.apply(x, tp.SEQUENCE_AXIS, self.tp_group) if self.sequence_parallel else x

    def gather_sequence(self, x):
        # The whole-sequence block's input gradient is complete on every rank: backward keeps our piece.
        return GatherAlong.apply(x, tp.SEQUENCE_AXIS, self.tp_group, False) if self.sequence_parallel else x

    def tied_head(self, hidden, embedding_weight):
        if self.tp_group is None:
            return super().tied_head(hidden, embedding_weight)
        return paddle.matmul(tp.enter_region(hidden, self.tp_group, self.sequence_parallel), embedding_weight,
                             transpose_y=True)

    def router_stats_reduce(self):
        if self.router_stats_group is None:
            return None
        return lambda x: SumOverRanks.apply(x, self.router_stats_group)

    def local_expert_ids(self, expert_counts):
        if self.expert_group is None:
            return super().local_expert_ids(expert_counts)
        return local_expert_ids(expert_counts, self.expert_group.rank, self.expert_group.nranks)

    def dispatcher(self, expert_counts, renormalize_kept=False):
        if self.expert_group is None:
            return LocalDispatcher(renormalize_kept)
        if self.experts_on_tp_ranks:
            return TensorParallelExpertDispatcher(expert_counts, self.expert_group, renormalize_kept)
        return ExpertParallelDispatcher(expert_counts, self.expert_group, renormalize_kept)

    def predict(self, logits):
        if self.tp_group is None:
            return super().predict(logits)
        return tp.vocab_parallel_argmax(logits, self.tp_group)

    def cross_entropy_sum(self, logits, labels):
        if self.tp_group is None:
            return super().cross_entropy_sum(logits, labels)
        return tp.vocab_parallel_cross_entropy_sum(logits, labels, self.tp_group)


def build_plan(model_cfg, env) -> SingleDevicePlan:
    """The plan for this process's place in the layout."""
    router_stats_group = env.data_group if model_cfg.global_aux_loss and env.data_world > 1 else None
    if env.tp_group is None and env.expert_group is None and router_stats_group is None:
        return SingleDevicePlan(model_cfg.initializer_range)
    return ParallelPlan(model_cfg.initializer_range, env.tp_group, env.sequence_parallel, env.expert_group,
                        experts_on_tp_ranks=env.expert_group is not None and env.expert_group is env.tp_group,
                        router_stats_group=router_stats_group)
