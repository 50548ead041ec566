"""Rotary position embeddings: 1D for text, ERNIE's 3D (t, h, w) for image tokens, 2D inside the ViT.

Language model: position ids carry three axes ``[..., 3] = (t, h, w)``. Frequency slot ``i`` of the
``head_dim / 2`` slots rotates by ``pos[axis(i)] * theta ** (-2 i / head_dim)``, where the last ``t_slots``
slots read t and the others alternate h (even i) and w (odd i). Text tokens carry the same value on all
three axes, so for them this is ordinary 1D RoPE. Pairs are interleaved: (x[2i], x[2i+1]) rotate together.

The ViT has a layout of its own (``vision_rope_angles``, ``apply_rotary_half``).
"""

from __future__ import annotations

import paddle


def rope_angles(position_ids: paddle.Tensor, head_dim: int, theta: float, t_slots: int | None) -> paddle.Tensor:
    """Angles ``[..., head_dim / 2]`` for position ids ``[..., 3]``; ``t_slots=None`` means plain 1D (axis 0)."""
    half = head_dim // 2
    inv_freq = 1.0 / (theta ** (paddle.arange(0, half, dtype="float32") * 2.0 / head_dim))
    pos = position_ids.astype("float32")
    if t_slots is None:
        per_slot = pos[..., :1].expand(pos.shape[:-1] + [half])
    else:
        per_slot = paddle.index_select(pos, paddle.to_tensor(slot_axes(half, t_slots)), axis=-1)
    return per_slot * inv_freq


def slot_axes(half: int, t_slots: int) -> list[int]:
    """Which axis (0 = t, 1 = h, 2 = w) each frequency slot reads."""
    return [0 if i >= half - t_slots else 1 + (i % 2) for i in range(half)]


def apply_rotary(x: paddle.Tensor, angles: paddle.Tensor) -> paddle.Tensor:
    """Rotate ``x [batch, seq, heads, head_dim]`` by ``angles [batch, seq, head_dim / 2]``."""
    cos = paddle.cos(angles).unsqueeze(2)
    sin = paddle.sin(angles).unsqueeze(2)
    pairs = x.astype("float32").reshape(x.shape[:-1] + [x.shape[-1] // 2, 2])
    x0, x1 = pairs[..., 0], pairs[..., 1]
    out = paddle.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], axis=-1)
    return out.reshape(x.shape).astype(x.dtype)


def vision_rope_angles(rows_cols: paddle.Tensor, head_dim: int, theta: float) -> paddle.Tensor:
    """The ViT's angles ``[patches, head_dim / 2]`` for (row, col) ``[patches, 2]``: the first half of the slots
    read the row, the second half the column, each at frequencies ``theta ** (-4 j / head_dim)``,
    ``j < head_dim / 4`` (ERNIE-4.5-VL's ViT, as published)."""
    quarter = head_dim // 4
    inv_freq = 1.0 / (theta ** (paddle.arange(0, quarter, dtype="float32") * 4.0 / head_dim))
    pos = rows_cols.astype("float32")
    return paddle.concat([pos[:, :1] * inv_freq, pos[:, 1:] * inv_freq], axis=-1)


def apply_rotary_half(x: paddle.Tensor, angles: paddle.Tensor) -> paddle.Tensor:
    """Rotate ``x [..., patches, heads, head_dim]`` by ``angles [patches, head_dim / 2]``, pairing dimension ``i``
    with ``i + head_dim / 2`` (the ViT's layout; the language model pairs neighbours)."""
    cos = paddle.cos(angles).unsqueeze(-2)
    sin = paddle.sin(angles).unsqueeze(-2)
    first, second = paddle.chunk(x.astype("float32"), 2, axis=-1)
    out = paddle.concat([first * cos - second * sin, second * cos + first * sin], axis=-1)
    return out.astype(x.dtype)
