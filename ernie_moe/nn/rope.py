"""Rotary position embeddings: 1D for text, ERNIE's 3D (t, h, w) for image tokens, 2D inside the ViT.

Language model: position ids carry three axes ``[..., 3] = (t, h, w)``. Frequency slot ``i`` of the
``head_dim / 2`` slots rotates by ``pos[axis(i)] * theta ** (-2 i / head_dim)``, where the last ``t_slots``
slots read t and the others alternate h (even i) and w (odd i). Text tokens carry the same value on all
three axes, so for them this is ordinary 1D RoPE. Pairs are interleaved: (x[2i], x[2i+1]) rotate together.

The ViT has a layout of its own (``vision_rope_angles``, ``apply_rotary_half``).
"""

from __future__ import annotations

import numpy as np
import paddle


def rope_angles(position_ids: paddle.Tensor, head_dim: int, theta: float, t_slots: int | None) -> paddle.Tensor:
    """Angles ``[..., head_dim / 2]`` for position ids ``[..., 3]``; ``t_slots=None`` means plain 1D (axis 0)."""
    half = head_dim // 2
    inv_freq, axes = _frequencies(head_dim, theta, t_slots, position_ids.place)
    pos = position_ids.astype("float32")
    if axes is None:
        per_slot = pos[..., :1].expand(pos.shape[:-1] + [half])
    else:
        per_slot = paddle.index_select(pos, axes, axis=-1)
    return per_slot * inv_freq


_FREQUENCIES: dict[tuple, tuple[paddle.Tensor, paddle.Tensor | None]] = {}


def _frequencies(head_dim: int, theta: float, t_slots: int | None, place) -> tuple[paddle.Tensor, paddle.Tensor | None]:
    """(each slot's inverse frequency, the axis each slot reads), made once per shape and device: decoding asks
    for them at every new token."""
    key = (head_dim, theta, t_slots, str(place))
    if key not in _FREQUENCIES:
        half = head_dim // 2
        inv_freq = 1.0 / (theta ** (paddle.arange(0, half, dtype="float32") * 2.0 / head_dim))
        axes = None if t_slots is None else paddle.to_tensor(slot_axes(half, t_slots), place=place)
        _FREQUENCIES[key] = inv_freq, axes
    return _FREQUENCIES[key]


def slot_axes(half: int, t_slots: int) -> list[int]:
    """Which axis (0 = t, 1 = h, 2 = w) each frequency slot reads."""
    return [0 if i >= half - t_slots else 1 + (i % 2) for i in range(half)]


class Rotation:
    """A batch's rotary angles ``[..., head_dim / 2]`` (their positions' axes before the last), with the cosine and
    sine tables the plain formula multiplies by (``tables``: written out to the rotated tensor's shape, heads
    included), made once for every layer and projection that rotates by them. ``interleaved``: dimension pairs are
    neighbours (the language model); otherwise dimension ``i`` pairs with ``i + head_dim / 2`` (the ViT)."""

    def __init__(self, angles: paddle.Tensor, interleaved: bool):
        self.angles, self.interleaved = angles, interleaved
        self._per_dim: tuple[paddle.Tensor, paddle.Tensor] | None = None  # cosines and sines, one head's
        self._tables: dict[tuple, tuple[paddle.Tensor, paddle.Tensor]] = {}

    def tables(self, shape: list[int]) -> tuple[paddle.Tensor, paddle.Tensor]:
        """The cosines and sines for an ``x`` of ``shape``, written out for each head: Paddle's CPU kernels
        multiply by a table broadcast over the heads about 30 times slower than by one of ``x``'s own shape.
        Queries and keys (other head counts) share the cosines and sines."""
        key = tuple(shape)
        if key not in self._tables:
            if self._per_dim is None:
                per_dim = (paddle.repeat_interleave(self.angles, 2, axis=-1) if self.interleaved
                           else paddle.concat([self.angles, self.angles], axis=-1)).unsqueeze(-2)
                self._per_dim = paddle.cos(per_dim), paddle.sin(per_dim)
            cos, sin = self._per_dim
            self._tables[key] = cos.expand(shape), sin.expand(shape)
        return self._tables[key]


def rotate(x: paddle.Tensor, rotation: Rotation) -> paddle.Tensor:
    """``x cos + turn(x) sin`` in float32, where ``turn`` maps each pair ``(a, b)`` to ``(-b, a)``: a matmul by a
    constant signed permutation, so the whole rotation is four kernels."""
    h = x if x.dtype == paddle.float32 else x.astype("float32")
    cos, sin = rotation.tables(x.shape)
    out = h * cos + paddle.matmul(h, _quarter_turn(x.shape[-1], rotation.interleaved, x.place)) * sin
    return out if out.dtype == x.dtype else out.astype(x.dtype)


_TURNS: dict[tuple[int, bool, str], paddle.Tensor] = {}


def _quarter_turn(dim: int, interleaved: bool, place) -> paddle.Tensor:
    """``[dim, dim]``: ``x @ turn`` maps each pair ``(a, b)`` of ``x`` to ``(-b, a)`` (made once per device)."""
    key = (dim, interleaved, str(place))
    if key not in _TURNS:
        turn = np.zeros([dim, dim], np.float32)
        first = np.arange(0, dim, 2) if interleaved else np.arange(dim // 2)
        second = first + 1 if interleaved else first + dim // 2
        turn[second, first], turn[first, second] = -1.0, 1.0
        _TURNS[key] = paddle.to_tensor(turn, place=place)
    return _TURNS[key]


def apply_rotary(x: paddle.Tensor, angles: paddle.Tensor | Rotation) -> paddle.Tensor:
    """Rotate ``x [batch, seq, heads, head_dim]`` by ``angles [batch, seq, head_dim / 2]``, pairs interleaved."""
    return rotate(x, angles if isinstance(angles, Rotation) else Rotation(angles, interleaved=True))


def vision_rope_angles(rows_cols: np.ndarray, head_dim: int, theta: float) -> paddle.Tensor:
    """The ViT's angles ``[patches, head_dim / 2]`` for (row, col) ``[patches, 2]``: the first half of the slots
    read the row, the second half the column, each at frequencies ``theta ** (-4 j / head_dim)``,
    ``j < head_dim / 4`` (ERNIE-4.5-VL's ViT, as published). Made on the host from the host's patch positions,
    the device gets the angles (and :class:`Rotation` their tables) in one copy each."""
    quarter = head_dim // 4
    inv_freq = 1.0 / (theta ** (np.arange(quarter, dtype=np.float32) * np.float32(4.0 / head_dim)))
    pos = np.asarray(rows_cols, dtype=np.float32)
    return paddle.to_tensor(np.concatenate([pos[:, :1] * inv_freq, pos[:, 1:] * inv_freq], axis=-1))


def apply_rotary_half(x: paddle.Tensor, angles: paddle.Tensor | Rotation) -> paddle.Tensor:
    """Rotate ``x [..., patches, heads, head_dim]`` by ``angles [patches, head_dim / 2]``, pairing dimension ``i``
    with ``i + head_dim / 2`` (the ViT's layout; the language model pairs neighbours)."""
    return rotate(x, angles if isinstance(angles, Rotation) else Rotation(angles, interleaved=False))
