"""The prompts of the GRPO stage: a seeded shuffle of the training data, taken in global rounds (each data rank its
contiguous share of each), and a sample read as a prompt and the reference answer the rewards compare with."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from ...data.encoding.packing import BadSample, Encoded, split_answer
from ...data.encoding.tokenizer import Tokenizer
from ...data.feeding.plan import sample_order


@dataclass
class Prompt:
    encoded: Encoded
    reference: str  # the sample's own answer, as text, for the rewards
    slot: int  # its place in the run's shuffle of the prompts


class PromptOrder:
    """The run's prompt slots: rounds taken by every data rank together, so the position (``prompts_read``, what a
    checkpoint keeps) is the same everywhere; slot ``s`` is a sample of a seeded permutation of the data, a new one
    for each pass over it."""

    def __init__(self, samples: int, seed: int, data_rank: int, data_ranks: int):
        self.samples, self.seed, self.data_rank, self.data_ranks = samples, seed, data_rank, data_ranks
        self.prompts_read = 0  # global prompt slots taken so far
        self._order: tuple[int, np.ndarray] = (-1, np.zeros(0, np.int64))  # (pass over the data, its seeded order)

    def round(self, groups: int) -> range:
        """This rank's share of the next round of ``groups x data ranks`` global prompt slots."""
        first = self.prompts_read + self.data_rank * groups
        self.prompts_read += groups * self.data_ranks
        return range(first, first + groups)

    def index(self, slot: int) -> int:
        """The sample at ``slot`` of the run's shuffle (each pass's permutation made once)."""
        n = self.samples
        epoch, order = self._order
        if epoch != slot // n:
            self._order = epoch, order = slot // n, sample_order(self.seed, slot // n, n)
        return int(order[slot % n])


def asked(sample, encoder, tokenizer: Tokenizer, slot: int) -> Prompt:
    """A sample as a prompt and its reference answer. A conversation ending with an answer is asked without it,
    its assistant turn opened as generation opens it (the Thinking template's form where the data or the record
    asks for thinking); any other sample's last trained span is the answer (``split_answer``). BadSample where
    an image or a video is part of the answer."""
    conversation = sample.conversation
    if conversation is not None and conversation.messages[-1]["role"] == "assistant":
        answer = conversation.messages[-1]["content"]
        if any(part["type"] != "text" for part in answer):
            raise BadSample("visual_after_answer", "the answer holds an image or a video")
        question = dataclasses.replace(sample, conversation=dataclasses.replace(
            conversation, messages=conversation.messages[:-1]))
        return Prompt(encoder.prompt(question), "".join(part["text"] for part in answer), slot)
    parts = split_answer(encoder(sample))
    if parts is None:
        raise BadSample("visual_after_answer", "an image or a video follows the answer's start")
    prompt, answer, _ = parts
    answer = answer[:-1] if len(answer) and answer[-1] == tokenizer.eos_id else answer
    return Prompt(prompt, tokenizer.decode(answer.tolist()), slot)
