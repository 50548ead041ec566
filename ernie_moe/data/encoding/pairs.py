"""A preference pair (``data.formats.preference``) encoded into one row: ``prompt | last, chosen | last, rejected``,
both answers behind the shared prompt at the same positions, each seeing the prompt and not the other (the row's
``key_ends``), so one forward gives both answers' log-probabilities."""

from __future__ import annotations

from collections import Counter

import numpy as np

from ...batch import CHOSEN, IGNORE_INDEX, PAIR_SIDES, REJECTED
from ..formats.preference import Pair
from ..formats.sample import BadSample
from .packing import PAD_TYPE, Encoded, Encoder, Row


class PairEncoder:
    """Pairs -> rows of ``max_seq_len``, one pair each; unusable pairs raise BadSample (counted skips)."""

    def __init__(self, encoder: Encoder):
        self.encoder = encoder
        self.image_token_id = encoder.tok.image_token_id

    @property
    def stats(self) -> Counter:  # the data workers reset and read the counts of each sample
        return self.encoder.stats

    @stats.setter
    def stats(self, value: Counter) -> None:
        self.encoder.stats = value

    @property
    def max_seq_len(self) -> int:
        return self.encoder.max_seq_len

    def identity(self) -> dict:
        """The settings a pair's row depends on (what a length index is kept under)."""
        return {"pairs": self.encoder.identity()}

    def __call__(self, pair: Pair) -> Row:
        chosen, rejected = self.encoder.whole(pair.chosen), self.encoder.whole(pair.rejected)
        return pair_row(chosen, rejected, self.encoder.max_seq_len, self.encoder.tok.pad_id, self.image_token_id)


def _final_answer_start(e: Encoded) -> int:
    """The first token of the last run of trained tokens: the answer the pair compares."""
    trained = np.flatnonzero(e.target)
    gaps = np.flatnonzero(np.diff(trained) > 1)
    return int(trained[gaps[-1] + 1] if len(gaps) else trained[0])


def _common_prefix(a: Encoded, b: Encoded) -> int:
    n = min(len(a), len(b))
    same = (a.input_ids[:n] == b.input_ids[:n]) & (a.token_type_ids[:n] == b.token_type_ids[:n]) & \
        (a.position_ids[:n] == b.position_ids[:n]).all(axis=1)
    return int(np.argmin(same)) if not same.all() else n


def pair_row(chosen: Encoded, rejected: Encoded, length: int, pad_id: int, image_token_id: int) -> Row:
    """``prompt | last, chosen | last, rejected`` (see the module's text), padded to ``length``."""
    if len(chosen) == len(rejected) and (chosen.input_ids == rejected.input_ids).all():
        raise BadSample("equal_answers", "the chosen and the rejected answer are the same")
    starts = _final_answer_start(chosen), _final_answer_start(rejected)
    # the branches start at the token that predicts the first answer token, or earlier where the sides differ
    branch = min(_common_prefix(chosen, rejected), *starts) - 1
    if branch < 0:
        raise BadSample("pair_prompts_differ", "the two sides do not begin with the same prompt")
    placeholders = [int((e.input_ids == image_token_id).sum()) for e in (chosen, rejected)]
    if any(int((e.input_ids[:branch] == image_token_id).sum()) != n for e, n in zip((chosen, rejected), placeholders)):
        raise BadSample("image_in_answer", "an image or video follows the point where the two answers part")
    used = len(chosen) + len(rejected) - branch
    if used > length:
        raise BadSample("pair_over_max_seq_len", f"the prompt and both answers take {used} tokens, more than "
                                                 f"data.max_seq_len {length}")
    ids = np.full(length, pad_id, np.int64)
    labels = np.full(length, IGNORE_INDEX, np.int64)
    types = np.full(length, PAD_TYPE, np.int64)
    positions = np.zeros((length, 3), np.int64)
    sides = np.zeros(length, np.int64)
    key_ends = np.full(length, length, np.int64)
    doc_ids = np.ones(length, np.int64)
    ids[:branch], types[:branch], positions[:branch] = (a[:branch] for a in (chosen.input_ids,
                                                                               chosen.token_type_ids,
                                                                               chosen.position_ids))
    key_ends[:branch], doc_ids[:used] = used, 0
    at = branch
    for side, e, answer_start in ((CHOSEN, chosen, starts[0]), (REJECTED, rejected, starts[1])):
        n = len(e) - branch
        span = slice(at, at + n)
        ids[span], types[span], positions[span] = e.input_ids[branch:], e.token_type_ids[branch:], \
            e.position_ids[branch:]
        # position i predicts token i + 1: trained when that token is trained and part of the final answer
        nxt = np.arange(branch + 1, len(e) + 1)
        trained = np.zeros(n, bool)
        trained[:-1] = e.target[nxt[:-1]] & (nxt[:-1] >= answer_start)
        labels[span] = np.where(trained, np.append(e.input_ids[branch + 1:], pad_id), IGNORE_INDEX)
        sides[span] = side
        key_ends[span] = at + n if side == CHOSEN else used
        at += n
    return Row(ids, labels, np.zeros(length, np.int64), types, positions, doc_ids, key_ends, chosen.patches,
               chosen.grids, inputs={PAIR_SIDES: sides})
