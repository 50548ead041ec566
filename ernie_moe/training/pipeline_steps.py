"""A training step and an evaluation through fleet's pipeline schedule (``parallel.pipeline``)."""

from __future__ import annotations

import contextlib
import dataclasses

import numpy as np
import paddle

from ..batch import IGNORE_INDEX
from ..data import collate
from ..parallel.pipeline import stage_inputs
from .evaluate import SCORE_SIZE, batch_scores, eval_metrics


def pipeline_forward_backward(schedule, model, env, micro_batches, denominator: float,
                              precision=None) -> tuple[float, float]:
    """fleet's 1F1B (or interleaved) schedule over the micro-batches: what ``train_batch`` runs before its
    optimizer step. Returns the last stage's sums of the LM loss and of the router losses (0 elsewhere)."""
    loss = model.loss
    loss.reset()
    # fleet divides each micro-batch's loss by their number: the scale undoes it
    scale = env.data_world / denominator * len(micro_batches)
    if env.virtual_stages > 1:
        schedule.set_virtual_pipeline_rank(0)
    scaler = precision if precision is not None and precision.loss_scale != 1.0 else None  # fleet calls .scale()
    with precision.autocast() if precision is not None else contextlib.nullcontext():
        schedule.forward_backward_pipeline(stage_inputs(micro_batches, scale=scale), scaler)
    return loss.lm_sum, loss.router_sum


@paddle.no_grad()
def pipeline_evaluate(schedule, model, env, batches, training_cfg) -> dict:
    """Evaluation through fleet's schedule, forward only; the last stage's loss function scores each batch.

    The schedule takes ``gradient_accumulation_steps`` micro-batches of the training shape at a time: short
    batches and the last group are filled with unlabelled copies.
    """
    t = training_cfg
    loss, steps, rows_per_batch = model.loss, t.gradient_accumulation_steps, t.per_device_train_batch_size
    loss.score = lambda logits, labels, scored, lm_sum: batch_scores(model.plan, logits, labels, scored.numpy(),
                                                                     lm_sum)
    loss.reset()
    schedule.eval()  # the schedule then skips its shape checks on outputs that carry no gradient
    group: list = []
    for i, rows in enumerate(batches):
        if t.max_eval_batches and i >= t.max_eval_batches:
            break
        group.append(rows)
        if len(group) == steps:
            schedule.eval_batch(stage_inputs(*_scored(group, rows_per_batch), scale=1.0), compute_loss=True)
            group = []
    if group:
        group += [None] * (steps - len(group))
        schedule.eval_batch(stage_inputs(*_scored(group, rows_per_batch), scale=1.0), compute_loss=True)
    schedule.train()
    totals = paddle.to_tensor(np.sum(loss.scores, axis=0) if loss.scores else np.zeros(SCORE_SIZE))
    loss.score = None
    env.all_reduce_sum(totals, env.pp_group)
    return eval_metrics(env.all_reduce_sum(totals, env.data_group).numpy())


def _scored(group: list, rows_per_batch: int) -> tuple[list, list]:
    """Collated evaluation batches of ``rows_per_batch`` rows and their caption categories. Missing rows
    (a short batch, a None entry) are filled with unlabelled copies, which add nothing to the scores."""
    last = [rows for rows in group if rows][-1]
    micro, scored = [], []
    for rows in group:
        keep = len(rows) if rows else 0
        rows = rows or last
        rows = rows + [rows[-1]] * (rows_per_batch - len(rows))
        batch = collate(rows)
        labels, category = batch.labels.numpy(), np.stack([r.scored for r in rows])
        labels[keep:], category[keep:] = IGNORE_INDEX, 0
        micro.append(dataclasses.replace(batch, labels=paddle.to_tensor(labels)))
        scored.append(paddle.to_tensor(category))
    return micro, scored
