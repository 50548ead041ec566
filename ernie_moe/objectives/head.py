"""From the final hidden states to what an objective reads: logits, and each position's cross-entropy."""

from __future__ import annotations

import numpy as np
import paddle

from ..nn.recompute import recomputed


class Predictions:
    """The head and its cross-entropy over one batch's final hidden states, computed as the objective asks.

    ``head``: hidden states -> logits (the identity where ``final`` already holds the logits); ``chunk``: tokens
    per chunk of the head and loss (``training.loss_subbatch_seqlen``, 0: the whole sequence at once);
    ``train``: chunks are recomputed in the backward pass; ``keep_logits``: :meth:`summed` computes the whole
    logits and keeps them in :attr:`logits` (evaluation scores predictions).
    """

    def __init__(self, plan, head, final: paddle.Tensor, labels: paddle.Tensor, chunk: int, train: bool,
                 keep_logits: bool = False):
        self.plan, self.head, self.final, self.labels = plan, head, final, labels
        self.chunk, self.train, self.keep_logits = chunk, train, keep_logits
        self.logits: paddle.Tensor | None = None

    def summed(self) -> paddle.Tensor:
        """The cross-entropy summed over the label tokens."""
        if self.chunk and not self.keep_logits:
            return self.per_position().sum()
        self.logits = self.head(self.final)
        return self.plan.cross_entropy_sum(self.logits, self.labels)

    def kept_logits(self) -> paddle.Tensor:
        """The whole logits, kept for evaluation: those :meth:`summed` computed, or computed now for an objective
        that read other figures of the predictions."""
        if self.logits is None:
            self.logits = self.head(self.final)
        return self.logits

    def scaled(self, factor: float) -> Predictions:
        """The same head over ``final x factor``: logits times ``factor`` (the head is linear, without a bias)."""
        return Predictions(self.plan, self.head, self.final * factor, self.labels, self.chunk, self.train)

    def per_position(self) -> paddle.Tensor:
        """Each position's cross-entropy ``[batch, seq]`` (0 where the label is ignored)."""
        return token_losses(self.plan, self.head, self.final, self.labels, self.chunk, self.train)


def token_losses(plan, head, hidden: paddle.Tensor, labels: paddle.Tensor, chunk: int, train: bool) -> paddle.Tensor:
    """Each position's cross-entropy ``[batch, seq]`` of the final hidden states (``head``: hidden -> logits);
    with ``chunk``, over sequence chunks (``plan.loss_chunks``) whose logits are dropped after their loss in
    training and computed again in the backward pass, so that at most one chunk's are held."""

    def of(hidden_piece, label_piece):
        return plan.token_cross_entropy(head(hidden_piece), label_piece)

    if not chunk:
        return of(hidden, labels)
    parts, order = [], []
    for rows, positions in plan.loss_chunks(labels.shape[1], chunk):
        piece = hidden[:, rows], paddle.index_select(labels, paddle.to_tensor(positions), axis=1)
        parts.append(recomputed(of, *piece) if train else of(*piece))
        order.append(positions)
    losses, order = paddle.concat(parts, axis=1), np.concatenate(order)
    if (order == np.arange(len(order))).all():
        return losses
    return paddle.index_select(losses, paddle.to_tensor(np.argsort(order)), axis=1)  # back to sequence order
