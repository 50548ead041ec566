"""Two ways to run plain SwiGLU experts over expert-sorted rows, each with the autograd loop's result.

Both take ``rows [kept, hidden]``, in which expert j owns ``counts[j]`` consecutive rows, and the experts'
``up_gate [hidden, 2 * width]`` and ``down [width, hidden]`` weights, and return the output rows in the same
order. :func:`expert_loop` runs one expert after another; :func:`grouped_swiglu` runs each projection of all the
experts as one kernel: Paddle's grouped GEMM on a GPU (each expert's rows as they are), else one batched matmul
over the rows padded to the busiest expert's count.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import paddle
from paddle import _C_ops
from paddle.autograd import PyLayer

from ..nn import kernels


def _spans(counts: list[int]) -> list[tuple[int, int]]:
    starts = np.concatenate([[0], np.cumsum(counts)]).tolist()
    return list(zip(starts[:-1], starts[1:]))


class _ExpertLoop(PyLayer):
    """Expert by expert, with each expert's output rows written straight into one output tensor (``out=``), and
    each expert's input gradient into one gradient tensor: the rows are never split into per-expert copies nor
    concatenated back. An expert without rows gets a zero weight gradient, so gradient synchronisation sees
    every expert. The backward is autograd's, per expert: the same matmuls and the same swiglu gradient kernel.
    """

    @staticmethod
    def forward(ctx, rows, counts, *weights):
        n = len(counts)
        up_gate, down = weights[:n], weights[n:]
        out = paddle.empty([rows.shape[0], down[0].shape[1]], dtype=rows.dtype)
        activations = []
        for j, (start, end) in enumerate(_spans(counts)):
            if end > start:
                gate_up = paddle.matmul(rows[start:end], up_gate[j])
                hidden = kernels.swiglu(gate_up)
                paddle.matmul(hidden, down[j], out=out[start:end])
                activations += [gate_up, hidden]
        # which inputs want a gradient, read now: the tensors a recompute hands back to backward are detached
        ctx.counts, ctx.wants_grad = counts, [not t.stop_gradient for t in (rows, *weights)]
        ctx.save_for_backward(rows, *weights, *activations)
        return out

    @staticmethod
    def backward(ctx, grad):
        counts, n = ctx.counts, len(ctx.counts)
        wants_rows, wants_up_gate, wants_down = ctx.wants_grad[0], ctx.wants_grad[1:n + 1], ctx.wants_grad[n + 1:]
        saved = ctx.saved_tensor()
        rows, up_gate, down, activations = saved[0], saved[1:n + 1], saved[n + 1:2 * n + 1], iter(saved[2 * n + 1:])
        grad_rows = paddle.empty(rows.shape, dtype=rows.dtype) if wants_rows else None
        grad_up_gate, grad_down = [None] * n, [None] * n
        for j, (start, end) in enumerate(_spans(counts)):
            if end == start:
                grad_up_gate[j] = paddle.zeros_like(up_gate[j]) if wants_up_gate[j] else None
                grad_down[j] = paddle.zeros_like(down[j]) if wants_down[j] else None
                continue
            gate_up, hidden = next(activations), next(activations)
            grad_out = grad[start:end]
            if wants_down[j]:
                grad_down[j] = paddle.matmul(hidden, grad_out, transpose_x=True)
            grad_gate_up = _C_ops.swiglu_grad(gate_up, None, paddle.matmul(grad_out, down[j], transpose_y=True))[0]
            if wants_up_gate[j]:
                grad_up_gate[j] = paddle.matmul(rows[start:end], grad_gate_up, transpose_x=True)
            if wants_rows:
                paddle.matmul(grad_gate_up, up_gate[j], transpose_y=True, out=grad_rows[start:end])
        return grad_rows, *grad_up_gate, *grad_down


def expert_loop(rows: paddle.Tensor, counts: list[int], up_gate: list[paddle.Tensor],
                down: list[paddle.Tensor]) -> paddle.Tensor:
    """``down_j(swiglu(rows_j @ up_gate_j))`` for each expert j's rows, one expert after another (at least one
    row in all)."""
    return _ExpertLoop.apply(rows, counts, *up_gate, *down)


def grouped_swiglu(rows: paddle.Tensor, counts: list[int], up_gate: list[paddle.Tensor],
                   down: list[paddle.Tensor]) -> paddle.Tensor:
    """The same as :func:`expert_loop` for experts of one width, each projection as one kernel: Paddle's grouped
    GEMM where it runs (a GPU; checked against the padded form, forward and backward, at its first call:
    ``kernels.fused_or_plain``), else :func:`padded_swiglu`. A run without rows takes the padded form, which still
    gives every weight its (zero) gradient. Under autocast both compute in its dtype, as a batched matmul does
    there."""
    if rows.shape[0] == 0:
        return padded_swiglu(rows, counts, up_gate, down)
    if paddle.amp.is_autocast_enabled():  # so the first-call check compares, and keys, the dtype that runs
        rows = rows.astype(paddle.amp.get_autocast_dtype())
    n = len(counts)
    return kernels.fused_or_plain("grouped_gemm", [rows, *up_gate, *down],
                                  lambda rows, *w: grouped_gemm_swiglu(rows, counts, list(w[:n]), list(w[n:])),
                                  lambda rows, *w: padded_swiglu(rows, counts, list(w[:n]), list(w[n:])))


def grouped_gemm_swiglu(rows: paddle.Tensor, counts: list[int], up_gate: list[paddle.Tensor],
                        down: list[paddle.Tensor]) -> paddle.Tensor:
    """Paddle's grouped GEMM over the experts' weights, no padding (GPU only)."""
    if kernels.batched_gemm is None:
        raise NotImplementedError("this Paddle build has no batched_gemm")
    hidden = kernels.swiglu(_OverStackedWeights.apply(rows, _GroupedGemm(counts), *up_gate))
    return _OverStackedWeights.apply(hidden, _GroupedGemm(counts), *down)


class _PaddedBatch:
    """One batched matmul over ``x [experts, rows, in]``, every expert's rows padded with zeros to one count."""

    def __init__(self, counts: list[int]):
        self.counts = counts

    def forward(self, x, stacked):
        return paddle.bmm(x, stacked)

    def grad_x(self, grad, stacked):
        return paddle.matmul(grad, stacked, transpose_y=True)

    def grad_weights(self, x, grad):
        return paddle.matmul(x, grad, transpose_x=True)


class _GroupedGemm:
    """Paddle's grouped GEMM (``batched_gemm``) over ``x [rows, in]``, expert j owning ``counts[j]`` consecutive
    rows; its backward is two more grouped GEMMs: against the transposed weights, and each expert's
    ``x_j^T grad_j`` (the kernel's transposed-lhs form, whose inner dimension is the expert's row count)."""

    def __init__(self, counts: list[int]):
        self.counts = counts

    def forward(self, x, stacked):
        return kernels.batched_gemm(x, stacked, self.counts)

    def grad_x(self, grad, stacked):
        return kernels.batched_gemm(grad, stacked, self.counts, trans_rhs=True)

    def grad_weights(self, x, grad):
        return kernels.batched_gemm(x, grad, self.counts, trans_lhs=True)


class _OverStackedWeights(PyLayer):
    """``x`` times each expert's weight ``[in, out]`` in one kernel (``form``: :class:`_PaddedBatch` or
    :class:`_GroupedGemm`). The weights are stacked for the kernel here and again in backward, so the backward
    keeps the weights themselves, not a stacked copy. Each weight's gradient comes back in its own dtype; an
    expert without rows gets an exact zero, whatever a grouped kernel leaves in its slot."""

    @staticmethod
    def forward(ctx, x, form: _PaddedBatch | _GroupedGemm, *weights):
        # which inputs want a gradient, read now: the tensors a recompute hands back to backward are detached
        ctx.form, ctx.wants_grad = form, [not t.stop_gradient for t in (x, *weights)]
        ctx.save_for_backward(x, *weights)
        return form.forward(x, _stacked(weights, x.dtype))

    @staticmethod
    def backward(ctx, grad):
        x, *weights = ctx.saved_tensor()
        form, wants_x, wants_weights = ctx.form, ctx.wants_grad[0], ctx.wants_grad[1:]
        grad_x = form.grad_x(grad, _stacked(weights, x.dtype)) if wants_x else None
        per_expert = form.grad_weights(x, grad) if any(wants_weights) else None
        return grad_x, *[None if not wants else per_expert[j].astype(w.dtype) if form.counts[j] else
                         paddle.zeros_like(w) for j, (w, wants) in enumerate(zip(weights, wants_weights))]


def _stacked(weights: Sequence[paddle.Tensor], dtype) -> paddle.Tensor:
    """The experts' weights as one ``[experts, in, out]`` tensor in ``dtype``."""
    return paddle.stack(weights).astype(dtype)


def padded_swiglu(rows: paddle.Tensor, counts: list[int], up_gate: list[paddle.Tensor],
                  down: list[paddle.Tensor]) -> paddle.Tensor:
    """One batched matmul per projection: the rows are padded to the busiest expert's count with zeros,
    ``[experts, rows, hidden]``. Zero rows give zero outputs and add nothing to the weights' gradients."""
    experts, most, hidden = len(counts), max(max(counts), 1), rows.shape[1]
    # slot (e, i) of the padded batch reads row i of expert e, or the appended zero row
    source = np.full([experts, most], rows.shape[0], dtype="int64")
    for e, (start, end) in enumerate(_spans(counts)):
        source[e, :end - start] = np.arange(start, end)
    flat = paddle.concat([rows, paddle.zeros([1, hidden], dtype=rows.dtype)], axis=0)
    padded = paddle.gather(flat, paddle.to_tensor(source.reshape(-1))).reshape([experts, most, hidden])
    h = kernels.swiglu(_OverStackedWeights.apply(padded, _PaddedBatch(counts), *up_gate))
    out = _OverStackedWeights.apply(h, _PaddedBatch(counts), *down).reshape([experts * most, -1])
    kept = np.concatenate([e * most + np.arange(c) for e, c in enumerate(counts)]).astype("int64")
    return paddle.gather(out, paddle.to_tensor(kept))
