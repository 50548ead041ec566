"""Held-out evaluation: loss, next-token accuracy, and caption accuracy on the words only the image tells."""

from __future__ import annotations

import numpy as np
import paddle

from ..data import collate
from ..data.packing import SCORE_CATEGORIES


@paddle.no_grad()
def evaluate(model, batches, env, max_batches: int = 0) -> dict:
    was_training = model.training
    model.eval()
    categories = len(SCORE_CATEGORIES) + 1
    # loss sum, label tokens, correct tokens, then (scored, correct) per caption category
    totals = paddle.zeros([3 + 2 * categories], dtype="float64")
    for i, rows in enumerate(batches):
        if max_batches and i >= max_batches:
            break
        batch = collate(rows)
        out = model(batch, return_logits=True)
        has_label = batch.labels != -100
        correct = paddle.logical_and(model.plan.predict(out.logits) == batch.labels, has_label).numpy()
        category = np.stack([r.scored for r in rows])
        seen = np.bincount(category.reshape(-1), minlength=categories)
        right = np.bincount(category[correct], minlength=categories)
        totals += paddle.to_tensor(
            [float(out.loss_sum), float(has_label.sum()), float(correct.sum()), *seen, *right], dtype="float64")
    env.all_reduce_sum(totals, env.data_group)  # tensor-parallel ranks evaluated the same rows
    if was_training:
        model.train()
    values = totals.numpy()
    loss_sum, tokens, correct = values[:3]
    seen, right = values[3: 3 + categories], values[3 + categories:]
    if not tokens:
        return {}
    result = {"eval_loss": loss_sum / tokens, "eval_token_accuracy": correct / tokens}
    if seen[1:].sum():
        result["eval_caption_accuracy"] = right[1:].sum() / seen[1:].sum()
        for k, name in enumerate(SCORE_CATEGORIES, start=1):
            if seen[k]:
                result[f"eval_caption_accuracy_{name}"] = right[k] / seen[k]
    return result
