"""Weight-only quantisation of a linear weight ``W [in, out]`` (Paddle's order), symmetric, in Paddle ops.

- int8 (``wint8``): one scale per output column, ``scale = max |W[:, j]| / 127``, ``q = round(W / scale)`` in
  [-127, 127].
- int4 (``wint4``): one scale per output column and group of ``group`` input rows (the whole column when
  ``group`` is 0), ``scale = max |W[rows, j]| / 7``, ``q`` in [-7, 7], packed two to a byte along the input rows:
  row ``2i`` in the low four bits of byte row ``i``, row ``2i + 1`` in the high four.

``W ~ q x scale``; the dequantised weight is within half a step (scale / 2) of ``W`` in every element. A zero
column (or group) gets scale 0 and dequantises to zeros. ``column_max`` lets a weight split by input rows over
tensor-parallel ranks take the maximum over the whole column (an all-reduce), so each rank's scales and
integers are those of the whole weight.
"""

from __future__ import annotations

import paddle
from paddle.autograd import PyLayer

LEVELS = {"wint8": 127, "wint4": 7}


def _scales(w: paddle.Tensor, levels: int, group: int, column_max=None) -> paddle.Tensor:
    """``[groups, out]`` float32 scales (one group: the whole column)."""
    rows, cols = w.shape
    per = group or rows
    peak = w.astype("float32").abs().reshape([rows // per, per, cols]).max(axis=1)
    if column_max is not None and not group:
        peak = column_max(peak)
    return peak / levels


@paddle.no_grad()
def quantize(w: paddle.Tensor, mode: str, group: int = 0, column_max=None) -> tuple[paddle.Tensor, paddle.Tensor]:
    """(integers, scales ``[groups, out]``): int8 ``[in, out]`` for wint8, uint8 ``[in / 2, out]`` for wint4."""
    levels = LEVELS[mode]
    group = group if mode == "wint4" else 0
    rows, cols = w.shape
    per = group or rows
    scale = _scales(w, levels, group, column_max)
    safe = paddle.where(scale > 0, scale, paddle.ones_like(scale))
    q = paddle.round(w.astype("float32").reshape([rows // per, per, cols]) / safe.unsqueeze(1))
    q = paddle.clip(q, -levels, levels).reshape([rows, cols])
    if mode == "wint8":
        return q.astype("int8"), scale
    nibbles = (q + 16).astype("int32") % 16  # two's complement in four bits
    low, high = nibbles[0::2], nibbles[1::2]
    return (low + high * 16).astype("uint8"), scale


def unpack_int4(packed: paddle.Tensor) -> paddle.Tensor:
    """int32 ``[2 x rows, out]`` values in [-8, 7] from bytes of two four-bit halves (low half: the even row)."""
    b = packed.astype("int32")
    low, high = b % 16, b // 16
    pairs = paddle.stack([low, high], axis=1).reshape([-1, b.shape[1]])  # rows 2i, 2i + 1
    return paddle.where(pairs >= 8, pairs - 16, pairs)


def dequantize(q: paddle.Tensor, scale: paddle.Tensor, mode: str, dtype="float32") -> paddle.Tensor:
    """The weight ``[in, out]`` in ``dtype`` from :func:`quantize`'s integers and scales."""
    values = (unpack_int4(q) if mode == "wint4" else q).astype("float32")
    rows, cols = values.shape
    groups = scale.shape[0]
    w = values.reshape([groups, rows // groups, cols]) * scale.unsqueeze(1)
    return w.reshape([rows, cols]).astype(dtype)


def quantized_bytes(rows: int, cols: int, mode: str, group: int = 0) -> int:
    """Bytes of a quantised ``[rows, cols]`` weight and its float32 scales."""
    weight = rows * cols if mode == "wint8" else rows * cols // 2
    groups = rows // group if mode == "wint4" and group else 1
    return weight + 4 * groups * cols


class _QuantizedMatmul(PyLayer):
    """``x @ dequantize(q, scale)``, the weight dequantised again in backward: autograd keeps the integers, not
    a full-precision copy of the weight, between the passes (the weight takes no gradient)."""

    @staticmethod
    def forward(ctx, x, q, scale, mode):
        ctx.mode = mode
        ctx.save_for_backward(q, scale)
        return paddle.matmul(x, dequantize(q, scale, mode, x.dtype))

    @staticmethod
    def backward(ctx, grad):
        q, scale = ctx.saved_tensor()
        return paddle.matmul(grad, dequantize(q, scale, ctx.mode, grad.dtype), transpose_y=True), None, None


def quantized_matmul(x: paddle.Tensor, q: paddle.Tensor, scale: paddle.Tensor, mode: str) -> paddle.Tensor:
    return _QuantizedMatmul.apply(x, q, scale, mode)
