"""Each computation the model runs, on this device and in each dtype it trains in, against a plain NumPy
reference (float64) on small random inputs."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import paddle

from ..config.schema import ModelConfig
from ..data.encoding.packing import document_ends, document_starts
from ..model.attention import core_attention
from ..model.single_device import SingleDevicePlan
from ..moe.dispatcher import LocalDispatcher
from ..moe.expert_matmul import expert_loop, grouped_gemm_swiglu, grouped_swiglu
from ..nn import kernels, quant
from ..nn.flashmask import RowBounds
from ..nn.init import init_layer
from ..nn.kernels import TOLERANCE
from ..nn.layers import RMSNorm, SwiGLUMLP
from ..nn.rope import apply_rotary, apply_rotary_half, rope_angles, vision_rope_angles


@dataclass
class Check:
    name: str
    dtype: str
    difference: float  # largest |ours - reference| / max(|reference|, 1)
    tolerance: float

    @property
    def passed(self) -> bool:
        return bool(self.difference <= self.tolerance)


def _tensor(array: np.ndarray, dtype: Any) -> paddle.Tensor:
    return paddle.to_tensor(array.astype(np.float32)).astype(dtype)


def _flat(*tensors: paddle.Tensor | None) -> paddle.Tensor:
    """The tensors (an output, then gradients, which backward has filled) as one float32 vector."""
    assert all(t is not None for t in tensors)
    return paddle.concat([t.astype("float32").flatten() for t in tensors if t is not None])


def _silu(x):
    return x / (1 + np.exp(-x))


LONG_DOCUMENTS = ((300, 1, 200, 139), (639, 1))  # two rows' documents, two longer than a block of rows


def attention(rng, dtype, mask: str = "causal", fused: bool = False, heads: int = 4, kv_heads: int = 2,
              head_dim: int = 8, documents: tuple = LONG_DOCUMENTS):
    """Packed ``documents`` of mixed lengths, by default two longer than a block of rows (``nn.flashmask``), seen
    causally (the decoder) or whole (``mask="bidirectional"``), or one image's patches, every key seen
    (``mask="none"``, the ViT); then the gradients of ``sum(out * probe)``: [out, q, k and v gradients]."""
    if fused and dtype == "float32":  # Paddle's FlashMask kernel takes bf16 and fp16 only
        return None
    docs = np.stack([np.repeat(np.arange(len(lengths)), lengths) for lengths in documents])
    seq = docs.shape[1]
    q, k, v = (rng.standard_normal(shape) for shape in ([2, seq, heads, head_dim], [2, seq, kv_heads, head_dim],
                                                         [2, seq, kv_heads, head_dim]))
    probe = rng.standard_normal([2, seq, heads, head_dim])
    bounds = None if mask == "none" else RowBounds(
        paddle.to_tensor(np.stack([document_ends(d) for d in docs])),
        None if mask == "causal" else paddle.to_tensor(np.stack([document_starts(d) for d in docs])))
    leaves = [_tensor(a, dtype) for a in (q, k, v)]
    for t in leaves:
        t.stop_gradient = False
    q_in, k_in, v_in = leaves
    if fused:  # the fused checks are of masked attention
        assert bounds is not None
        out = kernels.fused_flashmask_attention(q_in, k_in, v_in, bounds)
    else:
        out = core_attention(q_in, k_in, v_in, bounds)
    (out.astype("float32") * _tensor(probe, "float32")).sum().backward()
    ours = _flat(out, *(leaf.grad for leaf in leaves))

    group = heads // kv_heads
    kk, vv = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
    scale = 1 / math.sqrt(head_dim)
    scores = np.einsum("bqhd,bkhd->bhqk", q, kk) * scale
    rows, keys = np.arange(seq)[:, None], np.arange(seq)[None, :]
    same = docs[:, :, None] == docs[:, None, :]
    allowed = {"none": np.ones_like(same), "bidirectional": same, "causal": same & (keys <= rows)}[mask]
    scores = np.where(allowed[:, None], scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    grad_probs = np.einsum("bqhd,bkhd->bhqk", probe, vv)
    grad_scores = probs * (grad_probs - (grad_probs * probs).sum(-1, keepdims=True))
    grad_q = np.einsum("bhqk,bkhd->bqhd", grad_scores, kk) * scale
    grad_k = np.einsum("bhqk,bqhd->bkhd", grad_scores, q) * scale
    grad_v = np.einsum("bhqk,bqhd->bkhd", probs, probe)
    grad_k, grad_v = (g.reshape(2, seq, kv_heads, group, head_dim).sum(3) for g in (grad_k, grad_v))
    expected = np.einsum("bhqk,bkhd->bqhd", probs, vv)
    return ours, np.concatenate([a.ravel() for a in (expected, grad_q, grad_k, grad_v)])


def rms_norm(rng, dtype, fused: bool = False, hidden: int = 16):
    x, w = rng.standard_normal([3, 5, hidden]), rng.standard_normal(hidden)
    reference = x / np.sqrt((x ** 2).mean(-1, keepdims=True) + 1e-6) * w
    if fused:
        return kernels.fused_rms_norm(_tensor(x, dtype), _tensor(w, "float32"), 1e-6), reference
    norm = RMSNorm(hidden, 1e-6)
    norm.weight.set_value(_tensor(w, "float32"))
    return norm(_tensor(x, dtype)), reference


def swiglu(rng, dtype):
    mlp = init_layer(SwiGLUMLP(SingleDevicePlan(0.2), 16, 24), seed=int(rng.integers(1 << 30)))
    x = rng.standard_normal([7, 16])
    mlp.to(dtype=dtype)
    up_gate = mlp.up_gate_proj.weight.astype("float32").numpy().astype(np.float64)
    down = mlp.down_proj.weight.astype("float32").numpy().astype(np.float64)
    gate, up = np.split(x @ up_gate, 2, axis=-1)
    return mlp(_tensor(x, dtype)), (_silu(gate) * up) @ down


def rotary(rng, dtype, fused: bool = False):
    """ERNIE's 3D positions: every token of the batch has angles of its own."""
    x, pos = rng.standard_normal([2, 7, 3, 16]), rng.integers(0, 50, size=[2, 7, 3])
    angles = rope_angles(paddle.to_tensor(pos), 16, 10000.0, t_slots=2)
    ours = kernels.fused_rotary(_tensor(x, dtype), angles, halves=False) if fused else apply_rotary(
        _tensor(x, dtype), angles)
    half = 8
    axis = [0 if i >= half - 2 else 1 + i % 2 for i in range(half)]
    angle = pos[..., axis] * 10000.0 ** (-(2.0 * np.arange(half)) / 16)
    cos, sin = np.cos(angle)[:, :, None], np.sin(angle)[:, :, None]
    ref = np.empty_like(x)
    ref[..., 0::2] = x[..., 0::2] * cos - x[..., 1::2] * sin
    ref[..., 1::2] = x[..., 0::2] * sin + x[..., 1::2] * cos
    return ours, ref


def vision_rotary(rng, dtype, fused: bool = False):
    """The ViT's layout: dimension i turns with i + 8, the first 4 slots by the patch row, the last 4 by its column."""
    x, rows_cols = rng.standard_normal([9, 3, 16]), rng.integers(0, 30, size=[9, 2])
    angles = vision_rope_angles(rows_cols, 16, 10000.0)
    ours = kernels.fused_rotary(_tensor(x, dtype).unsqueeze(0), angles, halves=True)[0] if fused else (
        apply_rotary_half(_tensor(x, dtype), angles))
    freq = 10000.0 ** (-4.0 * np.arange(4) / 16)
    angle = np.concatenate([rows_cols[:, :1] * freq, rows_cols[:, 1:] * freq], axis=-1)[:, None, :]  # [9, 1, 8]
    first, second = x[..., :8], x[..., 8:]
    cos, sin = np.cos(angle), np.sin(angle)
    return ours, np.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)


def dispatch_and_combine(rng, dtype):
    """Top-2 of 4 experts, expert j multiplying its rows by j + 1: each token's weighted sum."""
    x = rng.standard_normal([9, 8])
    experts = np.stack([rng.permutation(4)[:2] for _ in range(9)])
    weights = rng.random([9, 2])
    dispatcher = LocalDispatcher()
    rows, counts, state = dispatcher.dispatch(_tensor(x, dtype), paddle.arange(9), paddle.to_tensor(experts),
                                              paddle.to_tensor(weights.astype(np.float32)), 4, None)
    scale = np.repeat(np.arange(1, 5), counts).astype(np.float32)[:, None]
    ours = dispatcher.combine(rows * _tensor(scale, dtype), state, 9)
    return ours, x * ((experts + 1) * weights).sum(axis=1, keepdims=True)


def routed_experts(rng, dtype, grouped: bool = False, fused: bool = False, hidden: int = 8, width: int = 6):
    """Four SwiGLU experts over expert-sorted rows (one without rows), as the MoE layer runs them on this device
    (``fused``: Paddle's grouped GEMM itself), then the gradients of ``sum(out * probe)``: [out, row gradients,
    weight gradients]."""
    counts = [3, 0, 5, 2]
    rows, probe = rng.standard_normal([sum(counts), hidden]), rng.standard_normal([sum(counts), hidden])
    up_gate = [rng.standard_normal([hidden, 2 * width]) * 0.4 for _ in counts]
    down = [rng.standard_normal([width, hidden]) * 0.4 for _ in counts]
    x, ups, downs = _tensor(rows, dtype), [_tensor(w, dtype) for w in up_gate], [_tensor(w, dtype) for w in down]
    for t in (x, *ups, *downs):
        t.stop_gradient = False
    run = grouped_gemm_swiglu if fused else grouped_swiglu if grouped else expert_loop
    out = run(x, counts, ups, downs)
    (out.astype("float32") * _tensor(probe, "float32")).sum().backward()
    ours = _flat(out, x.grad, *(w.grad for w in ups + downs))

    expected_out, grad_rows = np.zeros_like(rows), np.zeros_like(rows)
    grad_up_gate, grad_down = [np.zeros_like(w) for w in up_gate], [np.zeros_like(w) for w in down]
    for j, (start, end) in enumerate(zip(np.cumsum([0] + counts[:-1]), np.cumsum(counts))):
        xj, gj = rows[start:end], probe[start:end]
        gate, up = np.split(xj @ up_gate[j], 2, axis=-1)
        sig = 1 / (1 + np.exp(-gate))
        h = gate * sig * up
        expected_out[start:end] = h @ down[j]
        grad_h = gj @ down[j].T
        grad_a = np.concatenate([grad_h * up * sig * (1 + gate * (1 - sig)), grad_h * gate * sig], axis=-1)
        grad_down[j], grad_up_gate[j] = h.T @ gj, xj.T @ grad_a
        grad_rows[start:end] = grad_a @ up_gate[j].T
    return ours, np.concatenate([a.ravel() for a in (expected_out, grad_rows, *grad_up_gate, *grad_down)])


def combine(rng, dtype, fused: bool = False):
    """12 expert-output rows summed into 5 tokens by weight (one token gets none, another four), then the
    gradients of ``sum(out * probe)`` for the rows and the weights: [out, row gradients, weight gradients]."""
    rows, weights, probe = rng.standard_normal([12, 8]), rng.random(12), rng.standard_normal([5, 8])
    tokens = np.array([0, 1, 1, 3, 3, 3, 3, 4, 0, 1, 4, 4])
    x, w = _tensor(rows, dtype), _tensor(weights, "float32")
    x.stop_gradient = w.stop_gradient = False
    if fused:  # token 3's four rows fill four slots
        out = kernels.fused_weighted_combine(x, paddle.to_tensor(tokens), w, 5, slots=4)
    else:
        out = kernels.plain_weighted_combine(x, paddle.to_tensor(tokens), w, 5)
    (out.astype("float32") * _tensor(probe, "float32")).sum().backward()
    ours = _flat(out, x.grad, w.grad)
    expected = np.zeros([5, 8])
    np.add.at(expected, tokens, rows * weights[:, None])
    return ours, np.concatenate([expected.ravel(), (probe[tokens] * weights[:, None]).ravel(),
                                 (probe[tokens] * rows).sum(-1)])


def loss(rng, dtype):
    logits, labels = rng.standard_normal([2, 5, 11]) * 3, rng.integers(0, 11, size=[2, 5])
    labels[0, :2] = -100
    ours = SingleDevicePlan().cross_entropy_sum(_tensor(logits, dtype), paddle.to_tensor(labels))
    top = logits.max(-1, keepdims=True)
    log_probs = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
    kept = labels != -100
    return ours, -np.take_along_axis(log_probs, np.where(kept, labels, 0)[..., None], -1)[..., 0][kept].sum()


def quantized_matmul(rng, dtype, mode: str):
    """A base linear held in 8 or 4 bits (training.quantize_base): ``x @ dequantised W`` against W quantised
    in NumPy (per output column; int4 in groups of 8 input rows), in float64."""
    x, w = rng.standard_normal([3, 4, 16]), rng.standard_normal([16, 6])
    levels, per = (127, 16) if mode == "wint8" else (7, 8)
    blocks = w.reshape(16 // per, per, 6)
    scale = np.abs(blocks).max(axis=1, keepdims=True).astype(np.float32).astype(np.float64) / levels
    weight = (np.clip(np.round(blocks / scale), -levels, levels) * scale).reshape(16, 6)
    q, scales = quant.quantize(paddle.to_tensor(w.astype(np.float32)), mode, 0 if mode == "wint8" else 8)
    return quant.quantized_matmul(_tensor(x, dtype), q, scales, mode), x @ weight


CHECKS: dict[str, Callable[..., Check]] = {"attention": attention,
          "attention, bidirectional documents": functools.partial(attention, mask="bidirectional"),
          "attention without a mask": functools.partial(attention, mask="none"),
          "rms_norm": rms_norm, "swiglu": swiglu, "rotary embedding": rotary, "vision rotary embedding": vision_rotary,
          "expert dispatch and combine": dispatch_and_combine, "moe combine with gradients": combine,
          "routed experts one by one, with gradients": routed_experts,
          "routed experts grouped, with gradients": functools.partial(routed_experts, grouped=True), "loss": loss,
          "int8 base weight matmul": functools.partial(quantized_matmul, mode="wint8"),
          "int4 base weight matmul": functools.partial(quantized_matmul, mode="wint4")}
# Paddle's GPU-only kernels, each against the reference its plain path meets above
FUSED_CHECKS = {f"{name}, fused kernel": functools.partial(CHECKS[name], fused=True)
                for name in ("attention", "attention, bidirectional documents", "rms_norm", "rotary embedding",
                             "vision rotary embedding", "moe combine with gradients",
                             "routed experts grouped, with gradients")}


def _on_gpu() -> bool:
    return paddle.is_compiled_with_cuda() and paddle.device.cuda.device_count() > 0


def device_dtypes() -> list[str]:
    """float32 everywhere; bfloat16 and float16 on a GPU that has them."""
    dtypes = ["float32"]
    if _on_gpu():
        if paddle.amp.is_bfloat16_supported():
            dtypes.append("bfloat16")
        if paddle.amp.is_float16_supported():
            dtypes.append("float16")
    return dtypes


def run_checks(dtypes: list[str], seed: int = 0, checks_to_run: dict | None = None) -> list[Check]:
    """``checks_to_run``: {name: make(rng, dtype)}; the built-in ones (and on a GPU the fused ones) by default."""
    checks = []
    for name, make in (checks_to_run or {**CHECKS, **(FUSED_CHECKS if _on_gpu() else {})}).items():
        for dtype in dtypes:
            made = make(np.random.default_rng(seed), dtype)
            if made is None:  # a kernel this dtype does not have
                continue
            ours, reference = made
            ours = ours.astype("float32").numpy().astype(np.float64)
            tolerance = TOLERANCE["float32 (TF32 matmuls)" if dtype == "float32" and _on_gpu() else dtype]
            checks.append(Check(name, dtype, kernels.relative_difference(ours, reference), tolerance))
    return checks


def model_checks(model_cfg: ModelConfig) -> dict:
    """The decoder's attention, norm and routed experts at a model's own widths (the fused kernels too, on a GPU):
    the shapes a config's training runs, which the built-in checks' small ones may not reach."""
    m = model_cfg
    head_dim = m.head_dim or m.hidden_size // m.num_attention_heads
    widths = sorted(set(m.moe_intermediate_size)) if m.moe_num_experts else []
    at_width = functools.partial(attention, heads=m.num_attention_heads, kv_heads=m.num_key_value_heads,
                                 head_dim=head_dim, documents=((30, 1, 20, 13), (63, 1)))
    makers = {f"attention, {m.num_attention_heads} heads / {m.num_key_value_heads} kv of {head_dim}": at_width,
              f"rms_norm, hidden {m.hidden_size}": functools.partial(rms_norm, hidden=m.hidden_size)}
    for width in widths:
        makers[f"routed experts, {m.hidden_size} x {width}"] = functools.partial(
            routed_experts, grouped=_on_gpu(), hidden=m.hidden_size, width=width)
        if _on_gpu():
            makers[f"routed experts, {m.hidden_size} x {width}, fused kernel"] = functools.partial(
                routed_experts, grouped=True, fused=True, hidden=m.hidden_size, width=width)
    if _on_gpu():
        makers[f"attention, {m.num_attention_heads} heads / {m.num_key_value_heads} kv of {head_dim}, fused kernel"] = \
            functools.partial(at_width, fused=True)
        makers[f"rms_norm, hidden {m.hidden_size}, fused kernel"] = functools.partial(
            rms_norm, fused=True, hidden=m.hidden_size)
    return makers
