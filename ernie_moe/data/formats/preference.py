"""Preference pairs (``training.stage: dpo``): one prompt, a chosen and a rejected answer, encoded into one row.

Records, one JSON object per line, recognised by their keys::

    {"images": ["cat.jpg"], "messages": [{"role": "user", "content": "<image>What is this?"}],
     "chosen": "A cat.", "rejected": "A dog."}                                         # common shape
    {"src": ["Hi", "And a cat?"], "tgt": ["Hello."], "response": [["It purrs."], ["It barks."]],
     "sort": [1, 0]}                                                                   # ERNIEKit's DPO shape

``messages`` (or TRL's ``prompt``) is the conversation up to the answer, written as chat records are
(``data.formats.jsonl``); ``chosen`` and ``rejected`` are each an answer text, an assistant message, or a list holding
one. In ERNIEKit's shape ``src`` has one question more than ``tgt`` has answers, and the higher ``sort`` marks the
chosen one of the two ``response`` answers.

Each side is encoded as the trainer encodes a conversation with that answer. The row holds the shared prompt
once and then each answer behind a copy of the prompt's last token (the one that predicts the answer's first
token), at the same positions: ``prompt | last, chosen | last, rejected``. The attention bound of each key
(``Row.key_ends``) lets both answers see the prompt and neither see the other, so the row gives both answers'
log-probabilities in one forward, the prompt's images through the ViT once. Only the final answer's tokens count.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .jsonl import JsonlDataset, parse_record
from .sample import BadSample, Chunk, Sample
from .synthetic import COLORS, COLUMNS, ROWS, SHAPES, SyntheticShapes


@dataclass
class Pair:
    chosen: Sample
    rejected: Sample


def is_pair_record(record: dict) -> bool:
    return ("chosen" in record and "rejected" in record) or ("response" in record and "sort" in record)


def side_records(record: dict, where: str) -> tuple[dict, dict]:
    """A pair record as the two SFT records (chosen, rejected) that share its prompt."""
    if "response" in record:
        return _erniekit_sides(record, where)
    if not ("chosen" in record and "rejected" in record):
        raise BadSample("wrong_format", f"{where} is not a preference pair (chosen / rejected, or ERNIEKit's "
                                        "src / tgt / response / sort)")
    prompt = record.get("messages", record.get("prompt"))
    if isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}]
    if not isinstance(prompt, list) or not prompt:
        raise BadSample("bad_record", f"{where}: messages (or prompt) must be a non-empty list of messages")
    rest = {k: v for k, v in record.items() if k not in ("messages", "prompt", "chosen", "rejected")}
    sides = [_answer(record[key], key, where) for key in ("chosen", "rejected")]
    chosen, rejected = ({**rest, "messages": [*prompt, {"role": "assistant", "content": text}]} for text in sides)
    return chosen, rejected


def _answer(value, key: str, where: str):
    """An answer's content: a text, an assistant message, or a list holding one message."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], dict):
        value = value[0]
    if isinstance(value, dict):
        if value.get("role", "assistant") != "assistant":
            raise BadSample("bad_record", f"{where}: {key} must be an assistant answer, not a {value.get('role')!r} "
                                          "message")
        value = value.get("content")
    if isinstance(value, str) and not value.strip():
        raise BadSample("empty_answer", f"{where}: the {key} answer is empty")
    if not isinstance(value, (str, list)) or not value:
        raise BadSample("bad_record", f"{where}: {key} must be a text or an assistant message")
    return value


def _erniekit_sides(record: dict, where: str) -> tuple[dict, dict]:
    src, tgt = ([v] if isinstance(v, str) else v for v in (record.get("src"), record.get("tgt", [])))
    response, sort = record["response"], record["sort"]
    if not (isinstance(src, list) and isinstance(tgt, list) and len(src) == len(tgt) + 1):
        raise BadSample("bad_turns", f"{where}: src must hold one text more than tgt (the question the responses "
                                     "answer)")
    if not (isinstance(response, list) and isinstance(sort, list) and len(response) == 2 and len(sort) == 2
            and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in sort)):
        raise BadSample("bad_record", f"{where}: response must hold two answers and sort their two ranks")
    if sort[0] == sort[1]:
        raise BadSample("bad_record", f"{where}: sort ranks both answers {sort[0]}: neither is preferred")
    texts = []
    for answer in response:
        answer = answer[0] if isinstance(answer, list) and len(answer) == 1 else answer
        if not isinstance(answer, str):
            raise BadSample("bad_record", f"{where}: each response must be a text (or a list of one text)")
        if not answer.strip():
            raise BadSample("empty_answer", f"{where}: a response is empty")
        texts.append(answer)
    chosen, rejected = (texts[0], texts[1]) if sort[0] > sort[1] else (texts[1], texts[0])
    rest = {k: v for k, v in record.items() if k not in ("src", "tgt", "response", "sort", "label")}
    first, second = ({**rest, "src": src, "tgt": [*tgt, text], "label": [0] * len(tgt) + [1]}
                     for text in (chosen, rejected))
    return first, second


class PreferenceJsonl(JsonlDataset):
    """A JSONL file of preference pairs."""

    def __getitem__(self, index: int) -> Pair:  # type: ignore[override]  # a pair of samples, each read as one is
        return self._pair(index, header_only=False)

    def shapes(self, index: int) -> Pair:  # type: ignore[override]
        """Pair ``index`` with only its images' sizes read: what its encoded length needs."""
        return self._pair(index, header_only=True)

    def _pair(self, index: int, header_only: bool) -> Pair:
        where = f"line {index + 1}"
        chosen, rejected = side_records(parse_record(self._line(index), where), where)
        return Pair(self.sample_of(chosen, where, header_only=header_only),
                    self.sample_of(rejected, where, header_only=header_only))


class SyntheticPairs(SyntheticShapes):
    """The synthetic shapes as pairs: the image and the caption's first word as the prompt, the true rest of the
    caption chosen, the same with one of its colour, shape, row or column words changed rejected."""

    WORDS = {"color": tuple(COLORS), "shape": SHAPES, "row": ROWS, "column": COLUMNS}

    def __getitem__(self, index: int) -> Pair:  # type: ignore[override]  # a pair of samples, each drawn as one is
        return self._pair(index, super().__getitem__(index))

    def shapes(self, index: int) -> Pair:  # type: ignore[override]
        """Pair ``index`` without its image drawn: what its encoded length needs."""
        return self._pair(index, super().shapes(index))

    def _pair(self, index: int, chosen: Sample) -> Pair:
        chosen.chunks[1].loss = False  # the caption's first word ("a") closes the prompt
        rng = np.random.default_rng([self.seed, self.split, index, 0x70616972])  # a stream of its own ("pair")
        changed = [i for i, c in enumerate(chosen.chunks) if c.scored][rng.integers(4)]
        chunk = chosen.chunks[changed]
        others = [w for w in self.WORDS[chunk.scored] if w != chunk.text.strip()]
        wrong = Chunk(text=" " + others[rng.integers(len(others))], loss=True, scored=chunk.scored)
        rejected = Sample(images=chosen.images, chunks=[*chosen.chunks[:changed], wrong, *chosen.chunks[changed + 1:]])
        return Pair(chosen, rejected)
