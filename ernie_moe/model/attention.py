"""Grouped-query self-attention with fused QKV, and the attention core shared with the ViT."""

from __future__ import annotations

import paddle
from paddle import nn

from ..config.schema import ModelConfig
from ..nn import contiguous, kernels
from ..nn.flashmask import RowBounds, dense_attention
from ..nn.recompute import Recomputable
from .single_device import SingleDevicePlan


def core_attention(q, k, v, bounds: RowBounds | None) -> paddle.Tensor:
    """softmax(q k^T / sqrt(d)) v over ``[batch, seq, heads, dim]``; key/value heads serve their groups of query
    heads (grouped-query attention).

    ``bounds``: which rows see each key, in FlashMask's form (``nn.flashmask``; the decoder's causal bounds are
    ``RowBounds(key_ends)``: token i sees token j when ``j <= i < key_ends[j]``, so a packed document's keys end
    where it ends, and a preference pair's chosen answer ends where its rejected answer begins). Paddle's
    FlashMask kernel on GPUs, the exact block-by-block path elsewhere: memory linear in the sequence either way.
    None (the ViT's attention within one image): every key (``nn.flashmask.dense_attention``).
    """
    if bounds is None:
        return dense_attention(q, k, v)
    return kernels.flashmask_attention(q, k, v, bounds)


class Attention(Recomputable, nn.Layer):
    def __init__(self, plan: SingleDevicePlan, cfg: ModelConfig):
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        qkv_out = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        # Fused q/k/v: under tensor parallelism each rank keeps whole heads of each of the three.
        self.qkv_proj = plan.column_linear(cfg.hidden_size, qkv_out, segments=[
            self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, self.num_kv_heads * self.head_dim])
        self.o_proj = plan.row_linear(self.num_heads * self.head_dim, cfg.hidden_size)

    def forward(self, x, angles, bounds, cache=None):
        """``cache`` (generation): keys and values of the earlier tokens, extended by these tokens'."""
        qkv = self.qkv_proj(x)  # the whole sequence, also when x is a sequence-parallel piece
        batch, seq = qkv.shape[0], qkv.shape[1]
        qkv = qkv.reshape([batch, seq, -1, self.head_dim])
        heads = qkv.shape[2]
        q_heads = heads * self.num_heads // (self.num_heads + 2 * self.num_kv_heads)
        kv_heads = (heads - q_heads) // 2
        q, k, v = contiguous.split(qkv, [q_heads, kv_heads, kv_heads], axis=2)
        q, k = kernels.rotary(q, angles), kernels.rotary(k, angles)
        if cache is not None:
            k, v = cache.extend(k, v)
        out = self.piece("core", q, k, v, bounds)
        return self.o_proj(out.reshape([batch, seq, -1]))

    def core(self, q, k, v, bounds):
        """softmax(q k^T) v: what the ``core_attn`` recompute drops."""
        return core_attention(q, k, v, bounds)
