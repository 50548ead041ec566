"""Paddle's fused kernels, chosen in one place.

SwiGLU runs Paddle's fused ``swiglu`` on every device: it has a CPU kernel, so the code GPUs run is the
code tested here. Paddle's fused RMSNorm, rotary embedding, MoE combine, grouped GEMM and FlashMask attention
(whose plain path is ``nn.flashmask.block_attention``) have no CPU kernel (the
RMSNorm's AVX-512 variant stops a CPU without AVX-512 with SIGILL), so they run only on a GPU, with the plain
formulas as their reference: ``python -m ernie_moe.doctor`` checks each fused kernel against NumPy on the user's
GPU.

A GPU-only kernel is also checked where it first runs: at its first call on a device and dtype, it and the
plain formula run forward and backward on copies of the same inputs, and their outputs and gradients are
compared. One that fails there or disagrees falls back to the plain path on that device and dtype, once, with a
warning, so a Paddle build whose kernel or gradient differs cannot train a different model. In a non-reentrant
recompute's first pass fleet's hooks take every tensor autograd saves, so no check can run there: a kernel not
yet checked takes the plain path there and in the pass that replays it, and its check waits for its first call
outside them (a layer that does not recompute, or evaluation).
"""

from __future__ import annotations

import re
import warnings

import numpy as np
import paddle
import paddle.nn.functional as F
from paddle import _C_ops
from paddle.autograd import PyLayer
from paddle.incubate.nn.functional import fused_rotary_position_embedding, moe_combine

from .flashmask import RowBounds, block_attention
from .recompute import replaying, saved_tensors_hooked
from .rope import Rotation, rotate

try:  # Paddle's grouped GEMM; a build without it runs the padded batched matmul (``moe.expert_matmul``)
    from paddle.incubate.nn.functional import batched_gemm
except ImportError:
    batched_gemm = None  # type: ignore[assignment]

# largest difference allowed, relative to the reference's largest magnitude; float32 matmuls on GPUs may run in
# TF32 (10-bit mantissa)
TOLERANCE = {"float32": 1e-5, "float32 (TF32 matmuls)": 2e-3, "bfloat16": 3e-2, "float16": 5e-3}

_FUSED_WORKS: dict[tuple[str, str, str], bool] = {}  # (kernel, place, dtype) -> whether the fused kernel is used
_MATMULS = {"grouped_gemm", "flashmask"}  # kernels made of matmuls


def swiglu(gate_up: paddle.Tensor) -> paddle.Tensor:
    """``silu(gate) * up`` for ``gate_up = [gate | up]`` on its last axis."""
    return F.swiglu(gate_up)


def as_float32(x: paddle.Tensor) -> paddle.Tensor:
    """``x`` in float32: itself when it already is (no copy, no kernel)."""
    return x if x.dtype == paddle.float32 else x.astype("float32")


def plain_rms_norm(x: paddle.Tensor, weight: paddle.Tensor, eps: float) -> paddle.Tensor:
    """In float32 whatever the input dtype, cast back at the end."""
    h = as_float32(x)
    h = h * paddle.rsqrt(paddle.square(h).mean(axis=-1, keepdim=True) + eps)
    out = h * as_float32(weight)
    return out if out.dtype == x.dtype else out.astype(x.dtype)


def fused_rms_norm(x: paddle.Tensor, weight: paddle.Tensor, eps: float) -> paddle.Tensor:
    return F.rms_norm(x, x.shape[-1:], weight.astype(x.dtype), eps)[0]


def rms_norm(x: paddle.Tensor, weight: paddle.Tensor, eps: float) -> paddle.Tensor:
    return fused_or_plain("rms_norm", [x, weight], lambda x, w: fused_rms_norm(x, w, eps),
                          lambda x, w: plain_rms_norm(x, w, eps))


def fused_rotary(x: paddle.Tensor, angles: paddle.Tensor, halves: bool) -> paddle.Tensor:
    """Paddle's fused rotary embedding over ``x [batch, seq, heads, head_dim]``: ``halves`` pairs dimension i with
    i + head_dim / 2 (``rope.apply_rotary_half``), otherwise neighbours (``rope.apply_rotary``).

    ``angles`` is ``[seq, head_dim / 2]`` (every row of the batch alike) or ``[batch, seq, head_dim / 2]``: then
    the sine and cosine tables hold one row per token and ``position_ids`` points each token at its own row.
    The kernel reads one table entry per dimension, so each angle is written for both members of its pair.
    """
    batch, seq, _, dim = x.shape
    table = angles.reshape([-1, dim // 2])
    table = paddle.concat([table, table], axis=-1) if halves else paddle.repeat_interleave(table, 2, axis=-1)
    position_ids = None
    if angles.ndim == 3:
        position_ids = paddle.arange(batch * seq, dtype="int64").reshape([batch, seq])
    # Paddle names neighbouring pairs the "neox" style
    out, _, _ = fused_rotary_position_embedding(
        x, sin=paddle.sin(table).astype(x.dtype), cos=paddle.cos(table).astype(x.dtype),
        position_ids=position_ids, use_neox_rotary_style=not halves)
    return out


def rotary(x: paddle.Tensor, angles: paddle.Tensor | Rotation) -> paddle.Tensor:
    """The language model's rotation (``rope.apply_rotary``): ``x [batch, seq, heads, head_dim]``, ``angles
    [batch, seq, head_dim / 2]`` (or their :class:`~.rope.Rotation`, its tables made once for every layer)."""
    rotation = angles if isinstance(angles, Rotation) else Rotation(angles, interleaved=True)
    return fused_or_plain("rotary", [x], lambda x: fused_rotary(x, rotation.angles, halves=False),
                          lambda x: rotate(x, rotation))


def vision_rotary(x: paddle.Tensor, angles: paddle.Tensor | Rotation) -> paddle.Tensor:
    """The ViT's rotation (``rope.apply_rotary_half``): ``x [patches, heads, head_dim]``, ``angles [patches,
    head_dim / 2]`` (or their :class:`~.rope.Rotation`)."""
    rotation = angles if isinstance(angles, Rotation) else Rotation(angles, interleaved=False)
    return fused_or_plain("vision_rotary", [x],
                          lambda x: fused_rotary(x.unsqueeze(0), rotation.angles, halves=True)[0],
                          lambda x: rotate(x, rotation))


def ranks_within_groups(sorted_ids: paddle.Tensor, counts: paddle.Tensor) -> paddle.Tensor:
    """Each entry of ``sorted_ids`` (sorted, ``counts[i]`` entries of id i): its rank among the entries of its id."""
    first = paddle.cumsum(counts) - counts
    return paddle.arange(sorted_ids.shape[0], dtype="int64") - paddle.gather(first, sorted_ids)


def plain_weighted_combine(rows: paddle.Tensor, token_index: paddle.Tensor, weights: paddle.Tensor,
                           num_tokens: int) -> paddle.Tensor:
    return paddle.index_add(paddle.zeros([num_tokens, rows.shape[-1]], dtype=rows.dtype), token_index, 0,
                            rows * weights.unsqueeze(-1).astype(rows.dtype))


class _MoECombine(PyLayer):
    """Paddle's fused combine, with the backward ERNIE pairs it with: its grad kernel returns each slot's
    ``grad_y * x`` rows, summed here over the hidden axis into the weights' gradient."""

    @staticmethod
    def forward(ctx, x, weights, index):
        ctx.save_for_backward(x, weights, index)
        return moe_combine(x, weights, index)

    @staticmethod
    def backward(ctx, grad):
        x, weights, index = ctx.saved_tensor()
        grad_x, grad_weight_rows = _C_ops.moe_combine_grad(x, weights, index, grad)
        return grad_x, grad_weight_rows.sum(-1).reshape(weights.shape)


def fused_weighted_combine(rows: paddle.Tensor, token_index: paddle.Tensor, weights: paddle.Tensor,
                           num_tokens: int, slots: int) -> paddle.Tensor:
    """Paddle's ``moe_combine``: ``out[t] = sum_s weight[t, s] * rows[index[t, s]]`` over ``slots`` per token (at
    least the most rows any token has).

    A token's kept copies fill its first slots in row order; an empty slot has weight 0 (and reads row 0).
    """
    order = paddle.argsort(token_index, stable=True)
    rank = ranks_within_groups(paddle.gather(token_index, order), paddle.bincount(token_index, minlength=num_tokens))
    kept = token_index.shape[0]
    slot = paddle.scatter(paddle.zeros([kept], dtype="int64"), order, rank)
    flat = token_index * slots + slot
    index = paddle.scatter(paddle.zeros([num_tokens * slots], dtype="int32"), flat,
                           paddle.arange(kept, dtype="int32")).reshape([num_tokens, slots])
    slot_weights = paddle.scatter(paddle.zeros([num_tokens * slots], dtype=rows.dtype), flat,
                                  weights.astype(rows.dtype)).reshape([num_tokens, slots])
    return _MoECombine.apply(rows, slot_weights, index)


def weighted_combine(rows: paddle.Tensor, token_index: paddle.Tensor, weights: paddle.Tensor,
                     num_tokens: int, slots: int) -> paddle.Tensor:
    """``out[t]``: the sum of ``weights[r] * rows[r]`` over the rows r with ``token_index[r] == t`` (at most
    ``slots`` of them)."""
    if rows.shape[0] == 0:
        return plain_weighted_combine(rows, token_index, weights, num_tokens)
    return fused_or_plain("moe_combine", [rows, weights],
                          lambda rows, w: fused_weighted_combine(rows, token_index, w, num_tokens, slots),
                          lambda rows, w: plain_weighted_combine(rows, token_index, w, num_tokens))


def fused_flashmask_attention(q, k, v, bounds: RowBounds) -> paddle.Tensor:
    """Paddle's ``flashmask_attention`` (bf16 / fp16 on GPUs): the causal form takes each key's end row, the
    bidirectional one its end and start rows (the lower and upper triangles' bounds)."""
    if bounds.causal:
        rows = bounds.ends.unsqueeze(-1)
    else:
        assert bounds.starts is not None  # bidirectional bounds carry their start rows
        rows = paddle.stack([bounds.ends, bounds.starts], axis=-1)
    return F.flashmask_attention(q, k, v, rows.unsqueeze(1).astype("int32"), causal=bounds.causal)


def flashmask_attention(q, k, v, bounds: RowBounds) -> paddle.Tensor:
    """Attention over ``[batch, seq, heads, dim]`` under FlashMask's row ``bounds``."""
    if bounds.first_row or q.shape[1] != k.shape[1]:  # generation's steps: the kernel's rows start at 0
        return block_attention(q, k, v, bounds)
    return fused_or_plain("flashmask", [q, k, v], lambda q, k, v: fused_flashmask_attention(q, k, v, bounds),
                          lambda q, k, v: block_attention(q, k, v, bounds))


def fused_or_plain(kernel: str, inputs: list[paddle.Tensor], fused, plain) -> paddle.Tensor:
    """``fused(*inputs)`` where it is used on the first input's device and dtype (see the module docstring), else
    ``plain(*inputs)``. ``inputs`` are the tensors the kernel differentiates; the rest the functions hold."""
    x = inputs[0]
    if not _is_gpu(x.place):
        return plain(*inputs)
    key = (kernel, str(x.place), str(x.dtype))
    if not _FUSED_WORKS.get(key, True):
        return plain(*inputs)
    try:
        if key not in _FUSED_WORKS:
            if saved_tensors_hooked() or replaying():  # no check runs here; a replay repeats its first pass
                return plain(*inputs)
            difference = _largest_difference(inputs, fused, plain)
            if not difference <= _tolerance(kernel, x.dtype):
                return _fall_back(key, f"differs from the plain formula by {difference:.2e}", plain, inputs)
            _FUSED_WORKS[key] = True
        return fused(*inputs)
    except (RuntimeError, NotImplementedError, ValueError, OSError) as error:  # OSError: raised in a backward
        return _fall_back(key, f"failed ({_first_line(error)})", plain, inputs)


def _tolerance(kernel: str, dtype) -> float:
    name = str(dtype).split(".")[-1]
    if name == "float32" and kernel in _MATMULS:  # the kernel's and the plain path's matmuls may run in TF32
        return TOLERANCE["float32 (TF32 matmuls)"]
    return TOLERANCE.get(name, TOLERANCE["float32"])


def _largest_difference(inputs: list[paddle.Tensor], fused, plain) -> float:
    """The largest difference between the fused and the plain path's output and gradients, each relative to the
    plain one's largest magnitude (at least 1)."""
    results = [_output_and_gradients(inputs, run) for run in (fused, plain)]
    return max(relative_difference(a, b) for a, b in zip(*results))


def relative_difference(ours: np.ndarray, reference: np.ndarray) -> float:
    """The largest absolute difference, relative to the reference's largest magnitude (at least 1): what
    :data:`TOLERANCE` bounds."""
    return float(np.abs(ours - reference).max(initial=0.0)) / max(float(np.abs(reference).max(initial=0.0)), 1.0)


def _output_and_gradients(inputs: list[paddle.Tensor], run) -> list[np.ndarray]:
    """``run`` on detached copies of ``inputs``, then the gradients of ``sum(out * probe)`` for each copy that is
    floating point (zero where it has none), in float32; in training, evaluation or a recompute alike."""
    leaves = [t.detach() for t in inputs]
    for leaf in leaves:
        leaf.stop_gradient = not leaf.is_floating_point()
    trained = [leaf for leaf in leaves if not leaf.stop_gradient]
    with paddle.set_grad_enabled(True):
        out = run(*leaves).astype("float32")
        probe = paddle.cos(paddle.arange(out.numel(), dtype="float32") * 0.7).reshape(out.shape)
        grads = paddle.grad([(out * probe).sum()], trained, allow_unused=True)
    return [out.numpy()] + [np.zeros(leaf.shape, "float32") if g is None else g.astype("float32").numpy()
                            for leaf, g in zip(trained, grads)]


def _first_line(error: Exception) -> str:
    """The error itself, without the trace Paddle wraps around one raised in a backward pass."""
    inner = re.search(r"\w+Error: [^\n]*", str(error))
    return inner.group(0) if inner else (str(error).strip().splitlines() or [type(error).__name__])[0]


def _fall_back(key: tuple[str, str, str], why: str, plain, inputs: list[paddle.Tensor]) -> paddle.Tensor:
    _FUSED_WORKS[key] = False
    warnings.warn(f"Paddle's fused {key[0]} {why} on {key[1]} in {key[2]}; using the plain formula there.",
                  stacklevel=3)
    return plain(*inputs)


def _is_gpu(place) -> bool:
    return place.is_gpu_place()


def chosen_on(place) -> str:
    """Which kernels run on ``place``, for the doctor's report: on a GPU, "unchecked" for a GPU-only kernel whose
    first-call check has not run yet (the plain path runs until it has)."""
    def choice(kernel: str) -> str:
        works = [ok for (k, p, _), ok in _FUSED_WORKS.items() if k == kernel and p == str(place)]
        if not _is_gpu(place) or not all(works):
            return "plain"
        return "fused" if works else "unchecked"
    gpu_only = ("rms_norm", "rotary", "vision_rotary", "moe_combine", "grouped_gemm", "flashmask")
    return ", ".join(["swiglu fused"] + [f"{kernel} {choice(kernel)}" for kernel in gpu_only])
