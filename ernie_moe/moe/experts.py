"""Routed experts: SwiGLU MLPs, text experts first, then vision experts (ERNIE's numbering).

A process holds the experts its plan assigns to it (all of them on one device). Weights are drawn by
their stable names (``model.init``), which carry the global expert id, so an expert starts the same on
whichever rank holds it.

Two ways to run them, with the same result (``training.moe_expert_matmul``): one expert after another, or
grouped, every expert of a width in one padded batched matmul per projection (:func:`grouped_swiglu`). The
loop suits CPUs, where the arithmetic sets the time and padding only adds to it; the grouped run suits GPUs,
where 64 experts would otherwise launch their small matmuls one after another.
"""

from __future__ import annotations

import numpy as np
import paddle
from paddle import nn

from ..model import kernels
from ..model.layers import SwiGLUMLP


class Experts(nn.LayerList):
    def __init__(self, plan, hidden_size: int, expert_counts: list[int], widths: list[int]):
        width_of = [w for n, w in zip(expert_counts, widths) for _ in range(n)]
        self.global_ids = plan.local_expert_ids(expert_counts)
        super().__init__([SwiGLUMLP(plan.local(), hidden_size, width_of[j]) for j in self.global_ids])
        self.expert_matmul = "auto"  # training.moe_expert_matmul, set by use_expert_matmul

    def forward(self, inputs: list[paddle.Tensor]) -> tuple[list[paddle.Tensor], paddle.Tensor | None]:
        """Run expert j on ``inputs[j]``; returns the outputs and, in the loop, a zero that touches every idle
        expert.

        In the loop an expert that got no token still runs on one zero row, multiplied by 0, so its parameters
        take part in backward and gradient synchronisation never waits for a missing gradient. The grouped
        run needs no such zero: every expert's weights enter the batched matmul.
        """
        if self._grouped(inputs) and self._plain():
            outputs = []
            for start, end in self._runs_of_equal_width():
                experts = list(self)[start:end]
                outputs += grouped_swiglu(inputs[start:end], [e.up_gate_proj.weight for e in experts],
                                          [e.down_proj.weight for e in experts])
            return outputs, None
        outputs, idle = [], []
        for expert, x in zip(self, inputs):
            if x.shape[0] == 0:
                idle.append(expert(paddle.zeros([1, x.shape[1]], dtype=x.dtype)).sum() * 0.0)
            outputs.append(expert(x) if x.shape[0] else x)
        zero = paddle.add_n(idle) if idle else None
        return outputs, zero

    def _grouped(self, inputs) -> bool:
        return self.expert_matmul == "grouped" or (self.expert_matmul == "auto" and inputs[0].place.is_gpu_place())

    def _plain(self) -> bool:
        """Plain linears only: experts with LoRA pairs beside their weights run one by one."""
        return all(type(e.up_gate_proj) is nn.Linear and type(e.down_proj) is nn.Linear for e in self)

    def _runs_of_equal_width(self) -> list[tuple[int, int]]:
        widths = [e.intermediate_size for e in self]
        starts = [i for i in range(len(widths)) if i == 0 or widths[i] != widths[i - 1]]
        return list(zip(starts, starts[1:] + [len(widths)]))


def grouped_swiglu(inputs: list[paddle.Tensor], up_gate: list[paddle.Tensor],
                   down: list[paddle.Tensor]) -> list[paddle.Tensor]:
    """``down_e(swiglu(x_e @ up_gate_e))`` for every expert e at once: the rows are padded to the busiest
    expert's count with zeros, ``[experts, rows, hidden]``, and each projection is one batched matmul over
    the stacked weights. Zero rows give zero outputs and add nothing to the weights' gradients."""
    counts = [x.shape[0] for x in inputs]
    experts, rows, hidden = len(inputs), max(max(counts), 1), inputs[0].shape[1]
    # slot (e, i) of the padded batch reads row i of expert e's input, or the appended zero row
    total = sum(counts)
    source = np.full([experts, rows], total, dtype="int64")
    for e, (start, count) in enumerate(zip(np.cumsum([0] + counts[:-1]), counts)):
        source[e, :count] = np.arange(start, start + count)
    flat = paddle.concat(list(inputs) + [paddle.zeros([1, hidden], dtype=inputs[0].dtype)], axis=0)
    padded = paddle.gather(flat, paddle.to_tensor(source.reshape(-1))).reshape([experts, rows, hidden])
    h = kernels.swiglu(paddle.bmm(padded, paddle.stack(up_gate).astype(padded.dtype)))
    out = paddle.bmm(h, paddle.stack(down).astype(h.dtype)).reshape([experts * rows, -1])
    kept = np.concatenate([e * rows + np.arange(c) for e, c in enumerate(counts)]).astype("int64")
    return paddle.split(paddle.gather(out, paddle.to_tensor(kept)), counts, axis=0)


def use_expert_matmul(model, mode: str) -> None:
    """``training.moe_expert_matmul``: 'grouped', 'per_expert', or 'auto' (grouped where the tokens are on a
    GPU)."""
    for layer in model.sublayers():
        if isinstance(layer, Experts):
            layer.expert_matmul = mode
