"""Router losses, each computed on one modality's tokens and expert columns (float32)."""

from __future__ import annotations

import paddle
import paddle.nn.functional as F


def load_balance_loss(probs: paddle.Tensor, topk_idx: paddle.Tensor, reduce=None) -> paddle.Tensor:
    """``E * sum_e(me_e * ce_e)``: me = mean router probability, ce = fraction of tokens sent to e (detached).

    ``reduce`` sums the statistics over ranks that hold other tokens, so that the means are global.
    """
    num_experts = probs.shape[1]
    # a token's k choices are distinct experts, so counting the choices counts the tokens sent to each expert
    counts = paddle.bincount(topk_idx.flatten(), minlength=num_experts).astype("float32")
    prob_sum = probs.sum(axis=0)
    tokens = paddle.full([1], float(probs.shape[0]), dtype="float32")
    if reduce is not None:
        prob_sum, counts, tokens = reduce(prob_sum), reduce(counts), reduce(tokens)
    tokens = paddle.clip(tokens, min=1.0)
    return num_experts * ((prob_sum / tokens) * (counts / tokens)).sum()


def z_loss(logits: paddle.Tensor, reduce=None) -> paddle.Tensor:
    """``mean(logsumexp(logits)^2)``: keeps router logits small. ``reduce``: as in :func:`load_balance_loss`."""
    square_sum = paddle.square(paddle.logsumexp(logits, axis=-1)).sum().reshape([1])
    tokens = paddle.full([1], float(logits.shape[0]), dtype="float32")
    if reduce is not None:
        square_sum, tokens = reduce(square_sum), reduce(tokens)
    return (square_sum / paddle.clip(tokens, min=1.0)).reshape([])


def orthogonal_loss(weight: paddle.Tensor) -> paddle.Tensor:
    """``||W W^T - I||^2 / numel`` over the unit-normalised expert vectors (columns of ``weight [hidden, E]``)."""
    w = F.normalize(weight.astype("float32").T, axis=1)
    gram = paddle.matmul(w, w, transpose_y=True)
    eye = paddle.eye(gram.shape[0], dtype="float32")
    return paddle.square(gram - eye).sum() / float(gram.shape[0] * gram.shape[1])
