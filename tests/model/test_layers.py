import numpy as np
import paddle
from support.models import numpy_rope

from ernie_moe.config import load_config
from ernie_moe.data.encoding.packing import document_ends
from ernie_moe.model.attention import Attention
from ernie_moe.nn.flashmask import RowBounds
from ernie_moe.nn.init import init_layer
from ernie_moe.nn.layers import RMSNorm, SwiGLUMLP
from ernie_moe.nn.rope import rope_angles
from ernie_moe.parallel import SingleDevicePlan


def test_rmsnorm_matches_numpy():
    x = np.random.default_rng(0).standard_normal((3, 8)).astype(np.float32)
    norm = RMSNorm(8, 1e-5)
    norm.weight.set_value(np.linspace(0.5, 1.5, 8).astype(np.float32))
    expected = x / np.sqrt((x ** 2).mean(-1, keepdims=True) + 1e-5) * np.linspace(0.5, 1.5, 8)
    np.testing.assert_allclose(norm(paddle.to_tensor(x)).numpy(), expected, rtol=1e-5, atol=1e-6)


def test_swiglu_uses_gate_half_first():
    paddle.seed(0)
    mlp = init_layer(SwiGLUMLP(SingleDevicePlan(), 6, 4))
    x = np.random.default_rng(1).standard_normal((5, 6)).astype(np.float32)
    w = mlp.up_gate_proj.weight.numpy()
    gate, up = x @ w[:, :4], x @ w[:, 4:]
    expected = (gate / (1 + np.exp(-gate)) * up) @ mlp.down_proj.weight.numpy()
    np.testing.assert_allclose(mlp(paddle.to_tensor(x)).numpy(), expected, rtol=1e-5, atol=1e-6)


def test_grouped_query_attention_matches_numpy():
    cfg = load_config(None, ["model.hidden_size=12", "model.num_attention_heads=4", "model.num_key_value_heads=2",
                             "model.head_dim=6", "model.freq_allocation=1"]).model
    paddle.seed(0)
    attn = init_layer(Attention(SingleDevicePlan(), cfg))
    rng = np.random.default_rng(2)
    x = rng.standard_normal((1, 5, 12)).astype(np.float32)
    pos = np.array([[[0, 0, 0], [1, 1, 1], [1, 1, 2], [3, 3, 3], [0, 0, 0]]])
    doc = np.array([[0, 0, 0, 0, 1]])
    out = attn(paddle.to_tensor(x), rope_angles(paddle.to_tensor(pos), 6, cfg.rope_theta, 1),
               RowBounds(paddle.to_tensor(document_ends(doc[0])[None]))).numpy()

    qkv = (x @ attn.qkv_proj.weight.numpy()).reshape(1, 5, 8, 6)
    q, k, v = qkv[:, :, :4], qkv[:, :, 4:6], qkv[:, :, 6:]
    q, k = numpy_rope(q, pos, cfg.rope_theta, 1), numpy_rope(k, pos, cfg.rope_theta, 1)
    heads = []
    for h in range(4):
        kv = h // 2  # query heads 0,1 share KV head 0; 2,3 share KV head 1
        scores = q[0, :, h] @ k[0, :, kv].T / np.sqrt(6)
        allowed = np.tril(np.ones((5, 5), bool)) & (doc[0][:, None] == doc[0][None, :])
        scores = np.where(allowed, scores, -np.inf)
        probs = np.exp(scores - scores.max(1, keepdims=True))
        probs /= probs.sum(1, keepdims=True)
        heads.append(probs @ v[0, :, kv])
    expected = np.concatenate(heads, axis=-1) @ attn.o_proj.weight.numpy()
    np.testing.assert_allclose(out[0], expected, rtol=1e-4, atol=1e-5)
