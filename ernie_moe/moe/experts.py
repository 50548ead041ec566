"""Routed experts: SwiGLU MLPs, text experts first, then vision experts (ERNIE's numbering).

A process holds the experts its plan assigns to it (all of them on one device). Weights are drawn by
their stable names (``model.init``), which carry the global expert id, so an expert starts the same on
whichever rank holds it.
"""

from __future__ import annotations

import paddle
from paddle import nn

from ..model.layers import SwiGLUMLP


class Experts(nn.LayerList):
    def __init__(self, plan, hidden_size: int, expert_counts: list[int], widths: list[int]):
        width_of = [w for n, w in zip(expert_counts, widths) for _ in range(n)]
        self.global_ids = plan.local_expert_ids(expert_counts)
        super().__init__([SwiGLUMLP(plan.local(), hidden_size, width_of[j]) for j in self.global_ids])

    def forward(self, inputs: list[paddle.Tensor]) -> tuple[list[paddle.Tensor], paddle.Tensor]:
        """Run expert j on ``inputs[j]``; returns the outputs and a zero that touches every idle expert.

        An expert that got no token still runs on one zero row, multiplied by 0, so its parameters take
        part in backward and gradient synchronisation never waits for a missing gradient.
        """
        outputs, idle = [], []
        for expert, x in zip(self, inputs):
            if x.shape[0] == 0:
                idle.append(expert(paddle.zeros([1, x.shape[1]], dtype=x.dtype)).sum() * 0.0)
            outputs.append(expert(x) if x.shape[0] else x)
        zero = paddle.add_n(idle) if idle else None
        return outputs, zero
