import numpy as np
import paddle
from support.models import numpy_rope

from ernie_moe.nn.rope import apply_rotary, apply_rotary_half, rope_angles, vision_rope_angles


def test_3d_rope_matches_numpy():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 7, 3, 16)).astype(np.float32)
    pos = rng.integers(0, 50, size=(2, 7, 3))
    angles = rope_angles(paddle.to_tensor(pos), 16, 10000.0, t_slots=2)
    got = apply_rotary(paddle.to_tensor(x), angles).numpy()
    np.testing.assert_allclose(got, numpy_rope(x, pos, 10000.0, 2), rtol=1e-5, atol=1e-5)


def test_text_positions_reduce_to_relative_1d_rope():
    """Equal (t, h, w) -> 1D RoPE: q.k depends only on the distance between positions."""
    rng = np.random.default_rng(1)
    q = paddle.to_tensor(rng.standard_normal((1, 1, 1, 16)).astype(np.float32))
    k = paddle.to_tensor(rng.standard_normal((1, 1, 1, 16)).astype(np.float32))

    def score(pq, pk):
        aq = rope_angles(paddle.to_tensor([[[pq] * 3]]), 16, 10000.0, t_slots=2)
        ak = rope_angles(paddle.to_tensor([[[pk] * 3]]), 16, 10000.0, t_slots=2)
        return float((apply_rotary(q, aq) * apply_rotary(k, ak)).sum())

    assert abs(score(10, 7) - score(33, 30)) < 1e-4
    plain = rope_angles(paddle.to_tensor([[[5, 9, 11]]]), 16, 10000.0, t_slots=None)
    np.testing.assert_allclose(plain.numpy()[0, 0], 5 * 10000.0 ** (-(2.0 * np.arange(8)) / 16), rtol=1e-6)


def test_each_axis_drives_its_own_slots():
    base = np.array([[[4, 4, 4]]])
    moved_w = np.array([[[4, 4, 9]]])
    a = rope_angles(paddle.to_tensor(base), 16, 10000.0, t_slots=2).numpy()[0, 0]
    b = rope_angles(paddle.to_tensor(moved_w), 16, 10000.0, t_slots=2).numpy()[0, 0]
    changed = np.nonzero(~np.isclose(a, b))[0].tolist()
    assert changed == [1, 3, 5]  # odd slots outside the last two (t) read w


def numpy_vision_rope(x, rows_cols, theta):
    """Reference for the ViT: dimension i pairs with i + D/2; slot j < D/4 turns by row * theta^(-4j/D), slot
    D/4 + j by col * theta^(-4j/D)."""
    dim = x.shape[-1]
    inv = theta ** (-(4.0 * np.arange(dim // 4)) / dim)
    ang = np.concatenate([rows_cols[:, :1] * inv, rows_cols[:, 1:] * inv], axis=-1)[:, None, :]
    cos, sin = np.cos(ang), np.sin(ang)
    first, second = x[..., : dim // 2], x[..., dim // 2:]
    return np.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)


def test_vision_rope_matches_numpy():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((9, 2, 16)).astype(np.float32)
    rows_cols = rng.integers(0, 30, size=(9, 2))
    got = apply_rotary_half(paddle.to_tensor(x), vision_rope_angles(rows_cols, 16, 10000.0))
    np.testing.assert_allclose(got.numpy(), numpy_vision_rope(x, rows_cols, 10000.0), rtol=1e-5, atol=1e-5)
