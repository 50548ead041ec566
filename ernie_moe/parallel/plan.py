"""The one place that decides which linear, embedding, norm, loss and expert-dispatch pieces the model uses.

The model asks a plan for its parallelisable pieces and never checks how many processes exist.
``SingleDevicePlan`` (``model.single_device``) hands out the plain Paddle layers and keeps every expert local;
``ParallelPlan`` hands out tensor-parallel layers (optionally sequence-parallel) and keeps a share of the
experts, reached by all-to-all over an expert group (``moe_group: ep``) or gathered over the tensor-parallel
ranks (``mp``). :func:`build_plan` picks the one for this process.
"""

from __future__ import annotations

import copy

import numpy as np
import paddle

from ..config.schema import ModelConfig
from ..model.single_device import SingleDevicePlan
from ..model.vision import blank_merge_block, frame_shares
from ..moe.dispatcher import LocalDispatcher
from ..nn.layers import RMSNorm
from ..nn.param_spec import describe
from ..parallel.env import DistEnv
from . import tensor_parallel as tp
from .comm import GatherAlong, GatherRows, SplitAlong, SumOverRanks
from .expert_parallel import ExpertParallelDispatcher, TensorParallelExpertDispatcher, local_expert_ids


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
        describe(norm.weight, partial_over_tp=self.sequence_parallel)
        return norm

    def split_sequence(self, x):
        return SplitAlong.apply(x, tp.SEQUENCE_AXIS, self.tp_group) if self.sequence_parallel else x

    def gather_sequence(self, x):
        # The whole-sequence block's input gradient is complete on every rank: backward keeps our piece.
        return GatherAlong.apply(x, tp.SEQUENCE_AXIS, self.tp_group, False) if self.sequence_parallel else x

    def vision_encoder(self, vit):
        # Under sequence parallelism each rank runs the ViT over its share of the frames: its gradient is partial.
        for param in vit.parameters():
            describe(param, partial_over_tp=self.sequence_parallel)
        return vit

    def vision_features(self, vit, patches, grid_thw):
        if not self.sequence_parallel:
            return super().vision_features(vit, patches, grid_thw)
        shares = frame_shares(grid_thw, self.tp_group.nranks)
        start, stop, grid = shares[self.tp_group.rank]
        sizes = [end - first for first, end, _ in shares]
        if stop > start:
            return GatherRows.apply(vit(patches[start:stop], grid), sizes, self.tp_group)
        # no frame on this rank: a blank block times 0 gives every ViT weight its (zero) gradient, and its empty
        # slice the gather's rows in the dtype the other ranks send
        blank = vit(*blank_merge_block(vit.cfg, patches.dtype))
        return GatherRows.apply(blank[:0], sizes, self.tp_group) + blank.sum() * 0.0

    def loss_chunks(self, seq_len, chunk):
        if not self.sequence_parallel:
            return super().loss_chunks(seq_len, chunk)
        # each rank holds a piece of the sequence and a piece of every chunk: the head gathers the pieces, so a
        # chunk's logits are those of the ranks' runs of chunk / ranks positions, in rank order
        ranks = self.tp_group.nranks
        local, piece = seq_len // ranks, chunk // ranks
        return [(slice(start, start + piece),
                 np.concatenate([r * local + np.arange(start, min(start + piece, local)) for r in range(ranks)]))
                for start in range(0, local, piece)]

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

    def full_logits(self, logits):
        if self.tp_group is None:
            return super().full_logits(logits)
        return GatherAlong.apply(logits, -1, self.tp_group, False)  # each rank holds a slice of the vocabulary

    def predict(self, logits):
        if self.tp_group is None:
            return super().predict(logits)
        return tp.vocab_parallel_argmax(logits, self.tp_group)

    def cross_entropy_sum(self, logits, labels):
        if self.tp_group is None:
            return super().cross_entropy_sum(logits, labels)
        return tp.vocab_parallel_cross_entropy_sum(logits, labels, self.tp_group)

    def token_cross_entropy(self, logits, labels):
        if self.tp_group is None:
            return super().token_cross_entropy(logits, labels)
        return tp.vocab_parallel_cross_entropy(logits, labels, self.tp_group)


def build_plan(model_cfg: ModelConfig, env: DistEnv) -> SingleDevicePlan:
    """The plan for this process's place in the layout."""
    router_stats_group = env.data_group if model_cfg.global_aux_loss and env.data_world > 1 else None
    if env.tp_group is None and env.expert_group is None and router_stats_group is None:
        return SingleDevicePlan(model_cfg.initializer_range)
    return ParallelPlan(model_cfg.initializer_range, env.tp_group, env.sequence_parallel, env.expert_group,
                        experts_on_tp_ranks=env.expert_group is not None and env.expert_group is env.tp_group,
                        router_stats_group=router_stats_group)
