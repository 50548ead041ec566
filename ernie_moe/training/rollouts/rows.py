"""Sampled answers as training rows: the prompt, then the answer's tokens as labels, with the inputs the policy
loss reads (its group's advantage, the sampler's log-probability of each answer token) and the experts each token
went to under router replay."""

from __future__ import annotations

import numpy as np

from ...data.encoding.packing import Encoded, Row, make_row
from ...data.encoding.tokenizer import Tokenizer
from ...objectives.policy import ADVANTAGES, OLD_LOGPS, SAMPLER_LOGPS
from .sampling import Group


def group_rows(group: Group, advantages: np.ndarray, tokenizer: Tokenizer, length: int) -> list[Row]:
    """The group's answers as rows of ``length``, with their ``advantages``."""
    rows = []
    for answer, advantage, routes in zip(group.answers, advantages, group.routes):
        tokens = answer_tokens(answer, tokenizer)
        row = answer_row(group.prompt.encoded, tokens, length, tokenizer.pad_id)
        start = len(group.prompt.encoded) - 1  # the position whose label is the answer's first token
        logps = np.zeros(length, np.float32)
        logps[start:start + len(tokens)] = answer.logps
        # the sampler's kept where the old policy's forward replaces OLD_LOGPS
        row.inputs = {ADVANTAGES: np.array(advantage, np.float32), OLD_LOGPS: logps, SAMPLER_LOGPS: logps.copy()}
        row.routes = routes
        rows.append(row)
    return rows


def answer_tokens(answer, tokenizer: Tokenizer) -> list[int]:
    """What an answer trains on: its tokens, and the end-of-sentence token where it stopped there."""
    return answer.ids + ([tokenizer.eos_id] if answer.stop == "eos" else [])


def answer_row(prompt: Encoded, answer: list[int], length: int, pad_id: int) -> Row:
    """A training row of ``prompt`` followed by the text tokens ``answer``, which are its labels."""
    start = int(prompt.position_ids.max()) + 1
    positions = np.repeat(np.arange(start, start + len(answer))[:, None], 3, axis=1)
    n = len(answer)
    encoded = Encoded(np.append(prompt.input_ids, answer), np.append(np.zeros(len(prompt), bool), np.ones(n, bool)),
                      np.zeros(len(prompt) + n, np.int64), np.append(prompt.token_type_ids, np.zeros(n, np.int64)),
                      np.vstack([prompt.position_ids, positions]), prompt.patches, prompt.grids)
    return make_row([encoded], length, pad_id)
