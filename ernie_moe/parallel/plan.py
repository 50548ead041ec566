"""The one place that decides which linear, embedding and expert-dispatch classes the model uses.

The model asks a plan for its parallelisable pieces and never checks how many processes exist.
``SingleDevicePlan`` hands out the plain Paddle layers; a parallel plan replaces them with sharded
versions of the same shapes and names.
"""

from __future__ import annotations

import paddle
from paddle import nn

from ..moe.dispatcher import LocalDispatcher


class SingleDevicePlan:
    def __init__(self, initializer_range: float = 0.02):
        self.std = initializer_range

    def _weight(self):
        return paddle.ParamAttr(initializer=nn.initializer.Normal(std=self.std))

    def linear(self, in_features: int, out_features: int, bias: bool = False) -> nn.Linear:
        bias_attr = paddle.ParamAttr(initializer=nn.initializer.Constant(0.0)) if bias else False
        return nn.Linear(in_features, out_features, weight_attr=self._weight(), bias_attr=bias_attr)

    # Megatron's names: column-parallel layers split their output features, row-parallel their input.
    column_linear = linear
    row_linear = linear

    def embedding(self, num_embeddings: int, dim: int) -> nn.Embedding:
        return nn.Embedding(num_embeddings, dim, weight_attr=self._weight())

    def dispatcher(self) -> LocalDispatcher:
        return LocalDispatcher()

    def cross_entropy_sum(self, logits: paddle.Tensor, labels: paddle.Tensor) -> paddle.Tensor:
        """Summed token cross-entropy in float32; label -100 marks positions without a loss."""
        return paddle.nn.functional.cross_entropy(
            logits.astype("float32"), labels.unsqueeze(-1), ignore_index=-100, reduction="sum")
