"""Transposes and inner-axis splits that write their result out.

Paddle 3 makes a transpose or a split along an inner axis a view of its input (its stride kernels); the next op
that needs the data in order first copies the view element by element, which on a CPU takes about 20 times as long
as the transpose kernel writing it out (32K floats: 270 us against 12 us on this machine). Attention reads its
split and transposed heads straight away, so here those ops run with the stride kernels off for their own call:
the result is an ordinary tensor, and so is the gradient of a transpose (a split's is a concat, which is one).
"""

from __future__ import annotations

import contextlib

import numpy as np
import paddle
from paddle import _C_ops
from paddle.autograd import PyLayer
from paddle.base import core

_STRIDES = "FLAGS_use_stride_kernel"


@contextlib.contextmanager
def written_out():
    """Ops in the block write their results out instead of returning views."""
    flags = core.globals()
    before = flags[_STRIDES]
    flags[_STRIDES] = False
    try:
        yield
    finally:
        flags[_STRIDES] = before


class _Transpose(PyLayer):
    @staticmethod
    def forward(ctx, x, perm):
        ctx.inverse = np.argsort(perm).tolist()
        with written_out():
            return _C_ops.transpose(x, perm)

    @staticmethod
    def backward(ctx, grad):
        with written_out():
            return _C_ops.transpose(grad, ctx.inverse)


def transpose(x: paddle.Tensor, perm: list[int]) -> paddle.Tensor:
    """``x.transpose(perm)`` written out, and its gradient too."""
    return _Transpose.apply(x, list(perm))


def split(x: paddle.Tensor, sections: list[int] | int, axis: int) -> list[paddle.Tensor]:
    """``paddle.split`` whose pieces are written out."""
    with written_out():
        return paddle.split(x, sections, axis=axis)
