"""A micro-batch's loss terms and the step's weights on them: the objective's loss and the multi-token prediction
depths' beside it, written once for the model on one device and for a pipeline's last stage; the step's counts and
sums by name (their order is known in this file alone)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import paddle

from ..batch import HostCounts
from ..config.schema import TrainingConfig
from .base import Objective
from .head import Predictions, token_losses


def loss_sums(objective: Objective, predictions: Predictions, labels: paddle.Tensor,
              inputs: Sequence[paddle.Tensor | None],
              mtp_final: paddle.Tensor | None = None, mtp_labels: paddle.Tensor | None = None,
              ) -> tuple[paddle.Tensor, paddle.Tensor | None, paddle.Tensor | None]:
    """(the objective's loss summed over its units, its figures of each row or None, ``[depths]`` the MTP depths'
    cross-entropy sums or None). ``mtp_final``: the depths' final hidden states (logits where the predictions'
    head is the identity), depth after depth along the batch axis, with their labels ahead (``model.mtp``)."""
    loss_sum, figures = objective.loss(predictions, labels, *inputs)
    if mtp_final is None or mtp_labels is None:
        return loss_sum, figures, None
    depths = mtp_labels.shape[0] // labels.shape[0]
    per_position = token_losses(predictions.plan, predictions.head, mtp_final, mtp_labels, predictions.chunk,
                                predictions.train)
    return loss_sum, figures, per_position.reshape([depths, -1]).sum(axis=1)


def weighted_loss(loss_sum: paddle.Tensor, mtp_sums: paddle.Tensor | None,
                  scale: float | paddle.Tensor) -> paddle.Tensor:
    """What the backward pass starts from (besides the router losses): ``loss_sum x scale[0]``, plus each MTP
    depth's loss sum times its weight ``scale[1:]`` (:func:`loss_weights`; a number: the loss's alone)."""
    if not isinstance(scale, paddle.Tensor):
        return loss_sum * scale
    loss = loss_sum * scale[0]
    return loss if mtp_sums is None else loss + (mtp_sums * scale[1:]).sum()


def step_sums(loss_sum: paddle.Tensor, router_loss: paddle.Tensor, figures: paddle.Tensor | None,
              mtp_sums: paddle.Tensor | None) -> paddle.Tensor:
    """``[loss, router losses, the objective's figures summed over rows, the MTP depths' loss sums]`` of a
    micro-batch as one float64 vector, detached, on the device: what the step logs."""
    parts = [loss_sum.detach().reshape([1]), router_loss.detach().sum().reshape([1])]
    parts += [] if figures is None else [figures.detach().sum(axis=0)]
    parts += [] if mtp_sums is None else [mtp_sums.detach()]
    return paddle.concat([t.astype("float64") for t in parts])


def loss_weights(data_ranks: int, denominator: Callable[[paddle.Tensor], paddle.Tensor], units: paddle.Tensor,
                 labels_ahead: paddle.Tensor, mtp_lambda: float) -> paddle.Tensor:
    """``[1 + depths]``: the weights of a step's loss sums, the objective's then each MTP depth's (``labels_ahead``:
    the labels each depth trains on, over every rank). Every unit of the step (label token, pair) weighs the same
    however the batch is split over micro-batches and ranks; shared gradients are averaged over the data ranks,
    hence their number as a factor. An MTP depth's loss is a mean over its own labels, weighted lambda / depths
    (PaddleFormers' criterion). ``denominator``: what a loss summed over some units is divided by."""
    scale = (data_ranks / denominator(units)).reshape([1])
    depths = labels_ahead.shape[0]
    if not depths:
        return scale
    weights = data_ranks * mtp_lambda / depths / denominator(labels_ahead)
    return paddle.concat([scale, weights.reshape([depths])])


@dataclass(frozen=True)
class StepSums:
    """A step's :func:`step_sums`, summed over its micro-batches (and ranks), by name; device tensors."""

    loss: paddle.Tensor  # the objective's loss summed over its units
    router: paddle.Tensor  # the weighted router losses, summed over micro-batches
    figures: paddle.Tensor | None  # the objective's figures summed over rows (None: it has none)
    mtp: paddle.Tensor | None  # each MTP depth's loss sum (None: no depth trains)

    @classmethod
    def of(cls, sums: paddle.Tensor, figures: int, depths: int) -> StepSums:
        """``figures``: how many the objective has; ``depths``: the MTP depths that train beside it."""
        return cls(sums[0], sums[1], sums[2:2 + figures] if figures else None,
                   sums[2 + figures:2 + figures + depths] if depths else None)


@dataclass(frozen=True)
class StepCounts:
    """What a step's loss is a mean over, counted on the host before it runs and summed over the data ranks in one
    vector: the objective's units (label tokens, pairs, answers), the tokens read, and the labels each MTP depth
    trains on."""

    units: paddle.Tensor
    tokens: paddle.Tensor
    labels_ahead: paddle.Tensor  # [depths]

    @staticmethod
    def local(objective: Objective, counts: Sequence[HostCounts], depths: int) -> paddle.Tensor:
        """This rank's counts of its micro-batches, as the vector :meth:`of` reads once summed."""
        values = [sum(objective.units(c) for c in counts), sum(c.tokens for c in counts)]
        values += [sum(c.labels_ahead[k] for c in counts) for k in range(depths)]
        return paddle.to_tensor(values, dtype="float64")

    @classmethod
    def of(cls, totals: paddle.Tensor) -> StepCounts:
        return cls(totals[0], totals[1], totals[2:])


def loss_denominator(training_cfg: TrainingConfig, max_seq_len: int, micro_batch_size: int,
                     accumulation_steps: int, data_ranks: int) -> Callable[[paddle.Tensor], paddle.Tensor]:
    """What a loss summed over some units (a device count, or one per MTP depth) is divided by: their count, or
    with ``training.token_balance_loss`` a fixed number of tokens per micro-batch (ERNIE's token-balanced loss)."""
    t = training_cfg
    if t.token_balance_loss:
        per_micro = t.token_balance_seqlen or max_seq_len * micro_batch_size
        fixed = float(per_micro * accumulation_steps * data_ranks)
        return lambda units: paddle.full(units.shape, fixed, dtype="float32")
    return lambda units: paddle.clip(units, min=1.0).astype("float32")
