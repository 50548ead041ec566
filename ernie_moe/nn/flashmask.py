"""Attention under FlashMask's column-wise row bounds, computed a block of query rows at a time.

FlashMask describes a mask by two row indices per key column instead of a ``[seq, seq]`` tensor: key j is seen
by the rows ``starts[j] <= i < ends[j]`` (causal: from the key's own row). Packed documents, a preference pair's
shared prompt and the plain causal mask are all of this form, in O(seq) memory.

:func:`block_attention` is the exact computation in that form for any device: the scores of one block of query
rows at a time, never the whole ``[seq, seq]``, and in backward each block's probabilities recomputed from the
log-sum-exp kept per row (the flash-attention recurrence), so memory grows linearly with the sequence. It is the
reference that Paddle's ``flashmask_attention`` kernel (GPUs, ``nn.kernels.flashmask_attention``) is checked
against.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import paddle
import paddle.nn.functional as F
from paddle.autograd import PyLayer

from . import contiguous

BLOCK_ROWS = 512  # query rows per block: the transient is [batch, heads, BLOCK_ROWS, keys] float32 scores
_HIDDEN = -1e30  # the score of a key a row does not see; finite, so a row that sees no key gives no NaN


@dataclass(frozen=True)
class RowBounds:
    """Which rows see each key column: ``starts[b, j] <= row < ends[b, j]``.

    ``ends [batch, keys]``: the first row that no longer sees key j (``data.encoding.packing.Row.key_ends``).
    ``starts``: the first row that sees it; None for causal attention, where that is the key's own row.
    ``first_row``: the row index of the first query, when the queries are the last rows (generation, whose
    earlier rows are cached keys).
    """

    ends: paddle.Tensor
    starts: paddle.Tensor | None = None
    first_row: int = 0
    # the additive masks made of these bounds, by query count: every layer of a micro-batch shares them
    _biases: dict = field(default_factory=dict, compare=False, repr=False)
    # the one-head mask [batch, 1, queries, keys] where the host made it (:meth:`causal_on_host`)
    _host_bias: paddle.Tensor | None = field(default=None, compare=False, repr=False)

    @classmethod
    def causal_on_host(cls, ends: np.ndarray, queries: int, first_row: int) -> RowBounds:
        """Causal bounds of ``queries`` rows from ``first_row`` on, from the host's ``ends [batch, keys]``, with
        their mask made on the host where one block takes them (generation's steps: one copy to the device in place
        of the twenty-odd kernels that make it there)."""
        host_bias = None
        if queries <= BLOCK_ROWS:
            rows = np.arange(first_row, first_row + queries)[None, :, None]
            keys = np.arange(ends.shape[1])[None, None, :]
            seen = (rows < ends[:, None, :]) & (keys <= rows)
            host_bias = paddle.to_tensor(np.where(seen, 0.0, _HIDDEN).astype(np.float32)[:, None])
        return cls(paddle.to_tensor(ends), first_row=first_row, _host_bias=host_bias)

    @property
    def causal(self) -> bool:
        return self.starts is None

    def allowed(self, rows: paddle.Tensor, keys: int) -> paddle.Tensor:
        """``[batch, 1, len(rows), keys]`` booleans: whether each of ``rows`` (absolute indices) sees each of the
        first ``keys`` keys."""
        ends = self.ends[:, :keys].astype("int64")
        seen = rows[None, :, None] < ends[:, None, :]
        if self.causal:
            first = paddle.arange(keys, dtype="int64")[None, None, :]
        else:
            assert self.starts is not None  # bidirectional bounds carry their start rows
            first = self.starts[:, :keys].astype("int64")[:, None, :]
        return paddle.logical_and(seen, rows[None, :, None] >= first).unsqueeze(1)

    def dense(self, queries: int) -> paddle.Tensor:
        """The whole ``[batch, 1, queries, keys]`` mask: for queries that fit one block, and for tests."""
        rows = paddle.arange(self.first_row, self.first_row + queries, dtype="int64")
        return self.allowed(rows, self.ends.shape[1])

    def dense_bias(self, queries: int, heads: int) -> paddle.Tensor:
        """:meth:`dense` as a float32 score bias ``[batch, heads, queries, keys]`` (0 seen, ``_HIDDEN`` not), made once
        for all the layers. Written out for every head: Paddle's CPU kernels add a bias broadcast over the heads
        about 40 times slower than one of the scores' own shape."""
        if (queries, heads) not in self._biases:
            bias = self._host_bias
            if bias is None or bias.shape[2] != queries:
                bias = paddle.where(self.dense(queries), paddle.zeros([], "float32"),
                                    paddle.full([], _HIDDEN, "float32"))
            self._biases[queries, heads] = bias.expand([bias.shape[0], heads, *bias.shape[2:]])
        return self._biases[queries, heads]


def block_attention(q, k, v, bounds: RowBounds, block_rows: int = BLOCK_ROWS) -> paddle.Tensor:
    """softmax(q k^T / sqrt(d)) v over ``[batch, seq, heads, dim]`` under ``bounds``; key/value heads serve their
    groups of query heads (grouped-query attention). Over several blocks, scores and probabilities in float32.

    Queries that fit one block take :func:`dense_attention` under the dense mask instead: the same memory (one
    block's scores), without the Python loop (measured in ``benchmarks/bench_train.py``)."""
    if q.shape[1] <= block_rows:
        return dense_attention(q, k, v, bounds.dense_bias(q.shape[1], q.shape[2]))
    group = q.shape[2] // k.shape[2]
    k, v = (paddle.repeat_interleave(t, group, axis=2) if group > 1 else t for t in (k, v))
    q, k, v = (contiguous.transpose(t, [0, 2, 1, 3]) for t in (q, k, v))
    extra = [] if bounds.causal else [bounds.starts]
    out = _BlockAttention.apply(q, k, v, bounds.ends, *extra, first_row=bounds.first_row, block_rows=block_rows)
    return contiguous.transpose(out, [0, 2, 1, 3])


def dense_attention(q, k, v, bias: paddle.Tensor | None = None) -> paddle.Tensor:
    """softmax(q k^T / sqrt(d) + bias) v over ``[batch, seq, heads, dim]``, every score at once; ``bias``: ``[batch,
    heads, queries, keys]`` added to the scores, or None. Key/value heads serve their groups of query heads without
    copies: a group's queries stand one after another as the rows of one matmul."""
    batch, queries, heads, dim = q.shape
    kv_heads = k.shape[2]
    group = heads // kv_heads
    q = contiguous.transpose(q * (dim ** -0.5), [0, 2, 1, 3])
    k, v = contiguous.transpose(k, [0, 2, 1, 3]), contiguous.transpose(v, [0, 2, 1, 3])
    if group > 1:
        q = q.reshape([batch, kv_heads, group * queries, dim])
    scores = paddle.matmul(q, k, transpose_y=True)
    if bias is not None:
        bias = bias if bias.dtype == scores.dtype else bias.astype(scores.dtype)
        scores = scores + (bias.reshape(scores.shape) if group > 1 else bias)
    out = paddle.matmul(F.softmax(scores, axis=-1), v)
    if group > 1:
        out = out.reshape([batch, heads, queries, dim])
    return contiguous.transpose(out, [0, 2, 1, 3])


def _blocks(bounds: RowBounds, queries: int, keys: int, block_rows: int):
    """(first query, end query, keys that block's rows may see, the block's mask) for each block of rows."""
    for a in range(0, queries, block_rows):
        z = min(a + block_rows, queries)
        seen = min(bounds.first_row + z, keys) if bounds.causal else keys  # causal rows see no later key
        rows = paddle.arange(bounds.first_row + a, bounds.first_row + z, dtype="int64")
        yield a, z, seen, bounds.allowed(rows, seen)


def _probabilities(q_block, k, allowed, scale, lse=None):
    scores = paddle.matmul(q_block, k, transpose_y=True) * scale
    scores = paddle.where(allowed, scores, paddle.full([], _HIDDEN, dtype=scores.dtype))
    if lse is None:
        lse = paddle.logsumexp(scores, axis=-1)
    return paddle.exp(scores - lse.unsqueeze(-1)), lse


class _BlockAttention(PyLayer):
    """``[batch, heads, seq, dim]`` in and out; keeps q, k, v, the output and one log-sum-exp per row."""

    @staticmethod
    def forward(ctx, q, k, v, ends, starts=None, first_row=0, block_rows=BLOCK_ROWS):
        bounds = RowBounds(ends, starts, first_row)
        q32, k32, v32 = (t.astype("float32") for t in (q, k, v))
        scale = 1.0 / math.sqrt(q.shape[-1])
        outs, lses = [], []
        for a, z, seen, allowed in _blocks(bounds, q.shape[2], k.shape[2], block_rows):
            p, lse = _probabilities(q32[:, :, a:z], k32[:, :, :seen], allowed, scale)
            outs.append(paddle.matmul(p, v32[:, :, :seen]))
            lses.append(lse)
        out = paddle.concat(outs, axis=2)
        # held on ctx, not through save_for_backward: a non-reentrant recompute's hooks would take them and hand
        # back different tensors (they are linear in the sequence, so holding them costs what saving them would)
        ctx.bounds, ctx.block_rows, ctx.scale = bounds, block_rows, scale
        ctx.kept = (q, k, v, out, paddle.concat(lses, axis=2))
        return out.astype(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.kept
        bounds, scale = ctx.bounds, ctx.scale
        q32, k32, v32, g32 = (t.astype("float32") for t in (q, k, v, grad_out))
        row_dot = (g32 * out).sum(-1)  # sum_j p_ij dP_ij, per row
        grad_q = []
        grad_k, grad_v = paddle.zeros_like(k32), paddle.zeros_like(v32)
        for a, z, seen, allowed in _blocks(bounds, q.shape[2], k.shape[2], ctx.block_rows):
            p, _ = _probabilities(q32[:, :, a:z], k32[:, :, :seen], allowed, scale, lse[:, :, a:z])
            g = g32[:, :, a:z]
            grad_v[:, :, :seen] += paddle.matmul(p, g, transpose_x=True)
            grad_scores = p * (paddle.matmul(g, v32[:, :, :seen], transpose_y=True) - row_dot[:, :, a:z, None])
            grad_q.append(paddle.matmul(grad_scores, k32[:, :, :seen]) * scale)
            grad_k[:, :, :seen] += paddle.matmul(grad_scores, q32[:, :, a:z], transpose_x=True) * scale
        grads = [paddle.concat(grad_q, axis=2).astype(q.dtype), grad_k.astype(k.dtype), grad_v.astype(v.dtype)]
        return tuple(grads)
