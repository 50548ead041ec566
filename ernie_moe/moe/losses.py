"""Router losses, each computed on one modality's tokens and expert columns (float32)."""

from __future__ import annotations

import paddle
import paddle.nn.functional as F


def load_balance_loss(probs: paddle.Tensor, topk_idx: paddle.Tensor) -> paddle.Tensor:
    """``E * sum_e(me_e * ce_e)``: me = mean router probability, ce = fraction of tokens sent to e (detached)."""
    num_tokens, num_experts = probs.shape
    me = probs.mean(axis=0)
    chosen = F.one_hot(topk_idx, num_experts).sum(axis=1)  # [tokens, experts], 1 where chosen
    ce = (chosen.sum(axis=0) / num_tokens).detach()
    return num_experts * (me * ce).sum()


def z_loss(logits: paddle.Tensor) -> paddle.Tensor:
    """``mean(logsumexp(logits)^2)``: keeps router logits small."""
    return paddle.logsumexp(logits, axis=-1).pow(2).mean()


def orthogonal_loss(weight: paddle.Tensor) -> paddle.Tensor:
    """``||W W^T - I||^2 / numel`` over the unit-normalised expert vectors (columns of ``weight [hidden, E]``)."""
    w = F.normalize(weight.astype("float32").T, axis=1)
    gram = paddle.matmul(w, w, transpose_y=True)
    eye = paddle.eye(gram.shape[0], dtype="float32")
    return (gram - eye).pow(2).sum() / gram.numel().astype("float32")
