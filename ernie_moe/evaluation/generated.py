"""Held-out evaluation by generation (``training.eval_generate``): each sample's last trained span is the answer,
what precedes it the prompt; the greedy answer is scored against it.

- ``eval_generate_exact_match``: answers whose text equals the reference's (whitespace normalised);
- ``eval_generate_token_f1``: the mean F1 of the answer's words against the reference's (SQuAD's measure);
- ``eval_generate_caption_accuracy[_<word type>]``: on data that scores caption words (the synthetic task), the
  scored reference tokens the answer has at the same place, so it reads beside the teacher-forced
  ``eval_caption_accuracy``;
- ``eval_generate_reward_<name>`` and their weighted sum ``eval_generate_reward``: the rewards ``training.rewards``
  names (``objectives.rewards``), the mean over the answers;
- ``eval_draft_acceptance``: with multi-token prediction layers, the answers are decoded with one draft a step from
  the first depth (``generation.speculative``; greedy, so the same answers where the MoE layers are dropless), and
  this is the share of drafted tokens the model's own greedy choice kept.

Every data-parallel rank answers its share of the samples with the whole model, several side by side (each answer
the one its prompt gets alone); the sums are all-reduced.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import numpy as np
import paddle

from ..data.encoding.packing import BadSample, split_answer
from ..data.encoding.tokenizer import Tokenizer
from ..generation import Decoding, generate_batch
from ..generation.speculative import drafter, generate_speculative
from ..objectives.rewards import Reward, exact_match
from ..parallel.env import DistEnv
from ..parallel.pipeline import TrainedModel
from .token_scores import CATEGORIES, caption_accuracy

SUMS = 3 + 2 * CATEGORIES  # answered, exact matches, F1 sum, then (scored, right) per category
SIDE_BY_SIDE = 8  # samples decoded together (generation.generate_batch)


def token_f1(answer: str, reference: str) -> float:
    """F1 of the answer's words against the reference's, counted with multiplicity."""
    a, r = answer.split(), reference.split()
    if not a or not r:
        return float(a == r)
    common = sum((Counter(a) & Counter(r)).values())
    if not common:
        return 0.0
    precision, recall = common / len(a), common / len(r)
    return 2 * precision * recall / (precision + recall)


def answer_sums(generated: list[int], reference: np.ndarray, scored: np.ndarray, decode, eos_id: int,
                rewards: Sequence[Reward] = ()) -> np.ndarray:
    """One sample's contribution to :data:`SUMS`, then each reward's score."""
    if len(reference) and reference[-1] == eos_id:
        reference, scored = reference[:-1], scored[:-1]
    text, expected = decode(generated), decode(reference.tolist())
    sums = np.zeros(SUMS + len(rewards))
    sums[SUMS:] = [reward(text, expected) for reward in rewards]
    sums[:3] = 1.0, exact_match(text, expected), token_f1(text, expected)  # both read words, whatever the spacing
    placed = np.full(len(reference), -1)
    placed[: min(len(generated), len(reference))] = generated[: len(reference)]
    sums[3: 3 + CATEGORIES] = np.bincount(scored, minlength=CATEGORIES)
    sums[3 + CATEGORIES: SUMS] = np.bincount(scored[placed == reference], minlength=CATEGORIES)
    return sums


def generation_metrics(sums: np.ndarray, rewards: Sequence[Reward] = ()) -> dict:
    answered = sums[0]
    if not answered:
        return {}
    result = {"eval_generate_exact_match": sums[1] / answered, "eval_generate_token_f1": sums[2] / answered,
              "eval_generate_answers": answered}
    scores = sums[SUMS: SUMS + len(rewards)] / answered
    result.update({f"eval_generate_reward_{reward.name}": score for reward, score in zip(rewards, scores)})
    if rewards:
        result["eval_generate_reward"] = float(sum(r.weight * score for r, score in zip(rewards, scores)))
    return {**result, **caption_accuracy(sums[3: 3 + CATEGORIES], sums[3 + CATEGORIES: SUMS],
                                         "eval_generate_caption_accuracy")}


@paddle.no_grad()
def evaluate_by_generation(model: TrainedModel, dataset, encoder, tokenizer: Tokenizer, env: DistEnv, count: int,
                           max_new_tokens: int, rewards: Sequence[Reward] = ()) -> dict:
    """Greedy answers to the first ``count`` samples of ``dataset`` (0 = all), this rank's share of them, scored
    (and by ``rewards``)."""
    was_training = model.training
    model.eval()
    sums = np.zeros(SUMS + len(rewards))
    skipped: Counter = Counter()
    never = (model.cfg.im_patch_id,)  # images come from the prompt
    group = []  # samples answered side by side, SIDE_BY_SIDE at a time
    # the drafts: where the whole model is on every rank (no tensor or expert slices, which decode in step)
    drafting = drafter(model) is not None and env.tp_group is None and env.expert_group is None
    drafts = np.zeros(2)  # drafted, kept

    def answer(group):
        prompts, decodings = [prompt for prompt, _, _ in group], [Decoding(max_new_tokens)] * len(group)
        if drafting:
            outs = generate_speculative(model, prompts, decodings, tokenizer.eos_id, never=never,
                                        tokens=tokenizer.vocab_size, draft_tokens=1)
            drafts[:] += [sum(out.drafted for out in outs), sum(out.accepted for out in outs)]
        else:
            outs = generate_batch(model, prompts, decodings, tokenizer.eos_id, never=never,
                                  tokens=tokenizer.vocab_size)
        return sum(answer_sums(out.ids, reference, scored, tokenizer.decode, tokenizer.eos_id, rewards)
                   for out, (_, reference, scored) in zip(outs, group))

    for index in range(env.data_rank, count or len(dataset), env.data_world):
        try:
            parts = split_answer(encoder(dataset[index]))
        except BadSample as bad:
            skipped[bad.reason] += 1
            continue
        if parts is None:
            skipped["visual_after_answer"] += 1
            continue
        group.append(parts)
        if len(group) == SIDE_BY_SIDE:
            sums += answer(group)
            group = []
    if group:
        sums += answer(group)
    if was_training:
        model.train()
    totals = env.all_reduce_sum(paddle.to_tensor(np.concatenate([sums, drafts, [sum(skipped.values())]])),
                                env.data_group).numpy()
    result = generation_metrics(totals[:-3], rewards)
    drafted, kept = totals[-3:-1]
    if drafting and drafted:
        result["eval_draft_acceptance"] = float(kept / drafted)
    if totals[-1]:
        result["eval_generate_skipped"] = totals[-1]
    return result
