"""Routed experts: SwiGLU MLPs, text experts first, then vision experts (ERNIE's numbering).

A process holds the experts its plan assigns to it (all of them on one device). Weights are drawn by
their stable names (``nn.init``), which carry the global expert id, so an expert starts the same on
whichever rank holds it.

The experts take the dispatcher's rows sorted by expert, with the row count of each expert, and return their
outputs in the same order. Two ways to run them, with the same result (``training.moe_expert_matmul``): one
expert after another, or grouped, every expert of a width in one kernel per projection (``expert_matmul``:
Paddle's grouped GEMM on a GPU, a padded batched matmul elsewhere). The loop suits CPUs, where the arithmetic
sets the time and padding only adds to it; the grouped run suits GPUs, where 64 experts would otherwise launch
their small matmuls one after another.
"""

from __future__ import annotations

import paddle
from paddle import nn

from ..nn.layers import SwiGLUMLP
from .expert_matmul import expert_loop, grouped_swiglu


class Experts(nn.LayerList):
    def __init__(self, plan, hidden_size: int, expert_counts: list[int], widths: list[int]):
        width_of = [w for n, w in zip(expert_counts, widths) for _ in range(n)]
        self.global_ids = plan.local_expert_ids(expert_counts)
        super().__init__([SwiGLUMLP(plan.local(), hidden_size, width_of[j]) for j in self.global_ids])
        self.expert_matmul = "auto"  # training.moe_expert_matmul, set by use_expert_matmul

    def forward(self, rows: paddle.Tensor, counts: list[int]) -> tuple[paddle.Tensor, paddle.Tensor | None]:
        """Run local expert j on its ``counts[j]`` rows of ``rows``; returns the output rows and, where the experts
        run through autograd one by one, a zero that touches every idle expert.

        Plain experts run as one operation (grouped: one per width; :mod:`.expert_matmul`), which gives every
        expert a weight gradient, zero where it got no row. LoRA experts, the loop under autocast and a batch
        without rows go through autograd expert by expert, where an expert without rows runs on one zero row,
        multiplied by 0, so that its parameters take part in backward and gradient synchronisation never waits
        for a missing gradient.
        """
        if rows.shape[0] and self._plain():
            up_gate, down = [e.up_gate_proj.weight for e in self], [e.down_proj.weight for e in self]
            if self.expert_matmul == "grouped" or (self.expert_matmul == "auto" and rows.place.is_gpu_place()):
                outputs = [grouped_swiglu(rows[r0:r1], counts[e0:e1], up_gate[e0:e1], down[e0:e1])
                           for e0, e1, r0, r1 in self._runs_of_equal_width(counts)]
                return (outputs[0] if len(outputs) == 1 else paddle.concat(outputs, axis=0)), None
            if not paddle.amp.is_autocast_enabled():
                return expert_loop(rows, counts, up_gate, down), None
        return self.autograd_loop(rows, counts)

    def autograd_loop(self, rows: paddle.Tensor, counts: list[int]) -> tuple[paddle.Tensor, paddle.Tensor | None]:
        """Each expert's own layers on its split of the rows, then the outputs concatenated (see :meth:`forward`)."""
        outputs, idle = [], []
        for expert, x in zip(self, paddle.split(rows, counts, axis=0)):
            if x.shape[0] == 0:
                idle.append(expert(paddle.zeros([1, x.shape[1]], dtype=x.dtype)).sum() * 0.0)
            outputs.append(expert(x) if x.shape[0] else x)
        zero = paddle.add_n(idle) if idle else None
        return paddle.concat(outputs, axis=0), zero

    def _plain(self) -> bool:
        """Plain linears only: experts with LoRA pairs beside their weights run one by one."""
        return all(type(e.up_gate_proj) is nn.Linear and type(e.down_proj) is nn.Linear for e in self)

    def _runs_of_equal_width(self, counts: list[int]) -> list[tuple[int, int, int, int]]:
        """(first expert, end expert, first row, end row) of each run of consecutive experts of one width."""
        widths = [e.intermediate_size for e in self]
        starts = [i for i in range(len(widths)) if i == 0 or widths[i] != widths[i - 1]]
        runs = []
        for e0, e1 in zip(starts, starts[1:] + [len(widths)]):
            r0 = sum(counts[:e0])
            runs.append((e0, e1, r0, r0 + sum(counts[e0:e1])))
        return runs


def use_expert_matmul(model, mode: str) -> None:
    """``training.moe_expert_matmul``: 'grouped', 'per_expert', or 'auto' (grouped where the tokens are on a
    GPU)."""
    for layer in model.sublayers():
        if isinstance(layer, Experts):
            layer.expert_matmul = mode
