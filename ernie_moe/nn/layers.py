"""Small building blocks shared by the decoder, the experts and the adapter."""

from __future__ import annotations

import paddle
from paddle import nn

from . import kernels


class RMSNorm(nn.Layer):
    """Root-mean-square norm, in float32 whatever the input dtype (``kernels.rms_norm``)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = self.create_parameter([dim], default_initializer=nn.initializer.Constant(1.0))

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        return kernels.rms_norm(x, self.weight, self.eps)


class SwiGLUMLP(nn.Layer):
    """``down(silu(gate) * up)`` with gate and up fused in one ``up_gate_proj`` (gate half first)."""

    def __init__(self, plan, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.intermediate_size = intermediate_size
        self.up_gate_proj = plan.column_linear(hidden_size, 2 * intermediate_size,
                                               segments=[intermediate_size, intermediate_size])
        self.down_proj = plan.row_linear(intermediate_size, hidden_size)

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        return self.down_proj(kernels.swiglu(self.up_gate_proj(x)))
