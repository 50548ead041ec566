"""Small building blocks shared by the decoder, the experts and the adapter."""

from __future__ import annotations

import paddle
import paddle.nn.functional as F
from paddle import nn


class RMSNorm(nn.Layer):
    """Root-mean-square norm, computed in float32 whatever the input dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = self.create_parameter([dim], default_initializer=nn.initializer.Constant(1.0))

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        h = x.astype("float32")
        h = h * paddle.rsqrt(h.pow(2).mean(axis=-1, keepdim=True) + self.eps)
        return (h * self.weight.astype("float32")).astype(x.dtype)


class SwiGLUMLP(nn.Layer):
    """``down(silu(gate) * up)`` with gate and up fused in one ``up_gate_proj`` (gate half first)."""

    def __init__(self, plan, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.intermediate_size = intermediate_size
        self.up_gate_proj = plan.column_linear(hidden_size, 2 * intermediate_size,
                                               segments=[intermediate_size, intermediate_size])
        self.down_proj = plan.row_linear(intermediate_size, hidden_size)

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        gate, up = paddle.chunk(self.up_gate_proj(x), 2, axis=-1)
        return self.down_proj(F.silu(gate) * up)
