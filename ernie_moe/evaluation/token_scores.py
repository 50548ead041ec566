"""Held-out evaluation: loss, next-token accuracy, and caption accuracy on the words only the image tells."""

from __future__ import annotations

import numpy as np
import paddle

from ..batch import IGNORE_INDEX
from ..data import collate
from ..data.encoding.packing import SCORE_CATEGORIES
from ..parallel.env import DistEnv
from ..parallel.pipeline import TrainedModel

CATEGORIES = len(SCORE_CATEGORIES) + 1
SCORE_SIZE = 3 + 2 * CATEGORIES  # loss sum, label tokens, correct tokens, then (scored, correct) per category


def batch_scores(predicted, labels, scored, loss_sum) -> np.ndarray:
    """One batch's contribution to the evaluation sums; ``predicted`` holds the most likely token at each
    position, ``scored [rows, seq]`` each position's category."""
    has_label = labels != IGNORE_INDEX
    correct = paddle.logical_and(predicted == labels, has_label).numpy()
    category = np.asarray(scored)
    seen = np.bincount(category.reshape(-1), minlength=CATEGORIES)
    right = np.bincount(category[correct], minlength=CATEGORIES)
    return np.array([float(loss_sum), float(has_label.sum()), float(correct.sum()), *seen, *right])


@paddle.no_grad()
def evaluate(model: TrainedModel, batches, env: DistEnv, max_batches: int = 0) -> dict:
    was_training = model.training
    model.eval()
    totals = np.zeros(SCORE_SIZE)
    for i, rows in enumerate(batches):
        if max_batches and i >= max_batches:
            break
        batch = collate(rows)
        out = model(batch, return_logits=True)
        totals += batch_scores(model.plan.predict(out.logits), batch.labels, np.stack([r.scored for r in rows]),
                               out.loss_sum)
    if was_training:
        model.train()
    return eval_metrics(env.all_reduce_sum(paddle.to_tensor(totals), env.data_group).numpy())


def eval_metrics(values: np.ndarray) -> dict:
    """The evaluation figures from the sums over every batch and rank."""
    loss_sum, tokens, correct = values[:3]
    seen, right = values[3: 3 + CATEGORIES], values[3 + CATEGORIES:]
    if not tokens:
        return {}
    return {"eval_loss": loss_sum / tokens, "eval_token_accuracy": correct / tokens,
            **caption_accuracy(seen, right, "eval_caption_accuracy")}


def caption_accuracy(seen: np.ndarray, right: np.ndarray, name: str) -> dict:
    """``name`` (all scored words) and ``name_<word type>`` from the scored and right counts per category."""
    if not seen[1:].sum():
        return {}
    result = {name: right[1:].sum() / seen[1:].sum()}
    for k, category in enumerate(SCORE_CATEGORIES, start=1):
        if seen[k]:
            result[f"{name}_{category}"] = right[k] / seen[k]
    return result
