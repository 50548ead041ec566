"""The one place that decides which linear, embedding and expert-dispatch classes the model uses.

The model asks a plan for its parallelisable pieces and never checks how many processes exist.
``SingleDevicePlan`` hands out the plain Paddle layers and keeps every expert local;
``ExpertParallelPlan`` keeps a share of the experts and an all-to-all dispatcher.
"""

from __future__ import annotations

import copy

import paddle
from paddle import nn

from ..moe.dispatcher import LocalDispatcher
from .expert_parallel import ExpertParallelDispatcher, local_expert_ids


class SingleDevicePlan:
    def __init__(self, initializer_range: float = 0.02):
        self.std = initializer_range
        self.deferred_init = False

    def _weight(self):
        if self.deferred_init:
            return paddle.ParamAttr(initializer=nn.initializer.Constant(0.0))
        return paddle.ParamAttr(initializer=nn.initializer.Normal(std=self.std))

    def deferred(self):
        """The same plan, but its weights start at 0 without drawing random numbers (the caller fills them)."""
        plan = copy.copy(self)
        plan.deferred_init = True
        return plan

    def linear(self, in_features: int, out_features: int, bias: bool = False) -> nn.Linear:
        bias_attr = paddle.ParamAttr(initializer=nn.initializer.Constant(0.0)) if bias else False
        return nn.Linear(in_features, out_features, weight_attr=self._weight(), bias_attr=bias_attr)

    # Megatron's names: column-parallel layers split their output features, row-parallel their input.
    column_linear = linear
    row_linear = linear

    def embedding(self, num_embeddings: int, dim: int) -> nn.Embedding:
        return nn.Embedding(num_embeddings, dim, weight_attr=self._weight())

    def local_expert_ids(self, expert_counts: list[int]) -> list[int]:
        """Global ids of the routed experts this process holds."""
        return list(range(sum(expert_counts)))

    def dispatcher(self, expert_counts: list[int]) -> LocalDispatcher:
        return LocalDispatcher()

    def cross_entropy_sum(self, logits: paddle.Tensor, labels: paddle.Tensor) -> paddle.Tensor:
        """Summed token cross-entropy in float32; label -100 marks positions without a loss."""
        return paddle.nn.functional.cross_entropy(
            logits.astype("float32"), labels.unsqueeze(-1), ignore_index=-100, reduction="sum")


class ExpertParallelPlan(SingleDevicePlan):
    """Single-device layers, except that routed experts are split over ``group`` and reached by all-to-all."""

    def __init__(self, initializer_range: float, group):
        super().__init__(initializer_range)
        self.group = group

    def local_expert_ids(self, expert_counts: list[int]) -> list[int]:
        return local_expert_ids(expert_counts, self.group.rank, self.group.nranks)

    def dispatcher(self, expert_counts: list[int]) -> ExpertParallelDispatcher:
        return ExpertParallelDispatcher(expert_counts, self.group)


def build_plan(model_cfg, env) -> SingleDevicePlan:
    """The plan for this process's place in the layout."""
    if env.ep_group is not None:
        return ExpertParallelPlan(model_cfg.initializer_range, env.ep_group)
    return SingleDevicePlan(model_cfg.initializer_range)
