"""The pieces the model asks for, on one device: plain Paddle layers, every routed expert local.

``parallel.plan.ParallelPlan`` overrides them with split pieces where a layout needs them.
"""

from __future__ import annotations

import numpy as np
import paddle
from paddle import nn

from ..batch import IGNORE_INDEX
from ..moe.dispatcher import LocalDispatcher
from ..nn.init import mark_normal
from ..nn.layers import RMSNorm

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
        mark_normal(layer.weight, self.std)  # drawn by name once the model is built (nn.init)
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

    def vision_encoder(self, vit: nn.Layer) -> nn.Layer:
        """The ViT as built (a parallel plan marks how its gradients add up)."""
        return vit

    def vision_features(self, vit: nn.Layer, patches: paddle.Tensor, grid_thw) -> paddle.Tensor:
        """The ViT's features of every frame of the batch."""
        return vit(patches, grid_thw)

    def loss_chunks(self, seq_len: int, chunk: int) -> list[tuple[slice, np.ndarray]]:
        """(this rank's hidden positions, the sequence positions whose logits the head gives for them) of each
        chunk of the LM head and loss: consecutive runs of ``chunk`` positions."""
        return [(slice(start, start + chunk), np.arange(start, min(start + chunk, seq_len)))
                for start in range(0, seq_len, chunk)]

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

    def full_logits(self, logits: paddle.Tensor) -> paddle.Tensor:
        """Logits over the whole vocabulary (a sampler draws from them)."""
        return logits

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

    def token_cross_entropy(self, logits: paddle.Tensor, labels: paddle.Tensor) -> paddle.Tensor:
        """Each position's cross-entropy ``[batch, seq]`` in float32, 0 where the label is IGNORE_INDEX."""
        logits = logits.astype("float32")
        loss = paddle.nn.functional.cross_entropy(logits, labels.unsqueeze(-1), ignore_index=IGNORE_INDEX,
                                                  reduction="none").squeeze(-1)
        return loss + logits.detach().sum(axis=-1) * 0.0  # a non-finite logit stays visible, as above
