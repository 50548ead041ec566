"""Samples -> token sequences -> packed rows -> model batches.

A row holds whole samples back to back (each its own attention document) up to ``max_seq_len``.
Rows come out in an order fixed by the sample order alone, so any number of ranks can cut the same
global batch out of the same row stream.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np

from ..batch import IGNORE_INDEX
from .images import patchify, prepare
from .sample import Sample

PAD_TYPE = -1
# Caption-accuracy categories a data source may mark its words with.
SCORE_CATEGORIES = ("color", "shape", "row", "column")


def score_category(name: str) -> int:
    return SCORE_CATEGORIES.index(name) + 1 if name else 0


class BadSample(Exception):
    """A sample that cannot be used; ``reason`` is the counter it is reported under."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(detail or reason)
        self.reason = reason


@dataclass
class Encoded:
    input_ids: np.ndarray  # [n]
    target: np.ndarray  # [n] bool: token i is trained on (predicted from token i - 1)
    scored: np.ndarray  # [n] int: caption-accuracy category of token i (index into SCORE_CATEGORIES + 1), 0 = none
    token_type_ids: np.ndarray  # [n]
    position_ids: np.ndarray  # [n, 3]
    patches: list[np.ndarray]
    grids: list[np.ndarray]

    def __len__(self) -> int:
        return len(self.input_ids)


class Encoder:
    def __init__(self, tokenizer, model_cfg, max_seq_len: int, overlong: str, max_image_side: int, stats: Counter,
                 pixel_budget: tuple[int, int] | None = None):
        """``pixel_budget``: (min, max) pixels of an image after ERNIE's resize; None: ``max_image_side``."""
        self.tok = tokenizer
        self.pixel_budget = pixel_budget
        v = model_cfg.vision_config
        self.patch, self.merge, self.temporal = v.patch_size, v.spatial_merge_size, model_cfg.temporal_conv_size
        self.max_seq_len, self.overlong, self.max_side = max_seq_len, overlong, max_image_side
        self.stats = stats

    def __call__(self, sample: Sample) -> Encoded:
        """A training sample: the prompt, its trained tokens and the closing end-of-sentence token."""
        e = self.prompt(sample)
        if not e.target.any():
            raise BadSample("empty_text", "sample has no text to train on")
        next_position = e.position_ids[-1].max() + 1
        encoded = Encoded(np.append(e.input_ids, self.tok.eos_id), np.append(e.target, True), np.append(e.scored, 0),
                          np.append(e.token_type_ids, 0), np.vstack([e.position_ids, [[next_position] * 3]]),
                          e.patches, e.grids)
        return self._fit(encoded)

    def prompt(self, sample: Sample) -> Encoded:
        """The sample's tokens from the beginning-of-sentence token on, with no end: what generation
        continues."""
        ids, target, scored, types, positions = [self.tok.bos_id], [False], [0], [0], [(0, 0, 0)]
        patches, grids = [], []
        for chunk in sample.chunks:
            pos = max(positions[-1]) + 1
            if chunk.image >= 0:
                image = prepare(sample.images[chunk.image], self.patch * self.merge, self.max_side, self.pixel_budget)
                flat, grid = patchify(image, self.patch, self.merge)
                patches.append(flat)
                grids.append(grid)
                t = -(-int(grid[0]) // self.temporal)
                for tt, hh, ww in np.ndindex(t, grid[1] // self.merge, grid[2] // self.merge):
                    ids.append(self.tok.image_token_id)
                    positions.append((pos + tt, pos + hh, pos + ww))
                target += [False] * (len(ids) - len(target))
                scored += [0] * (len(ids) - len(scored))
                types += [1] * (len(ids) - len(types))
                continue
            pieces = self.tok.encode(chunk.text)
            for offset, token in enumerate(pieces):
                ids.append(token)
                positions.append((pos + offset,) * 3)
            target += [chunk.loss] * len(pieces)
            scored += [score_category(chunk.scored)] * len(pieces)
            types += [0] * len(pieces)
        return Encoded(np.array(ids, np.int64), np.array(target), np.array(scored, np.int64),
                       np.array(types, np.int64), np.array(positions, np.int64), patches, grids)

    def _fit(self, e: Encoded) -> Encoded:
        if len(e) <= self.max_seq_len:
            return e
        last_image = np.nonzero(e.token_type_ids > 0)[0]
        keep = self.max_seq_len
        if self.overlong == "skip" or (len(last_image) and last_image[-1] >= keep) or not e.target[:keep].any():
            raise BadSample("overlong_skipped", f"sample of {len(e)} tokens exceeds max_seq_len {self.max_seq_len}")
        self.stats["overlong_truncated"] += 1
        return Encoded(e.input_ids[:keep], e.target[:keep], e.scored[:keep], e.token_type_ids[:keep],
                       e.position_ids[:keep], e.patches, e.grids)


@dataclass
class Row:
    """One packed sequence as numpy arrays (see :class:`ernie_moe.model.Batch` for the fields)."""

    input_ids: np.ndarray
    labels: np.ndarray
    scored: np.ndarray
    token_type_ids: np.ndarray
    position_ids: np.ndarray
    doc_ids: np.ndarray
    patches: list[np.ndarray]
    grids: list[np.ndarray]


def pack(samples, max_seq_len: int, pad_id: int):
    """Greedy packing in stream order: a sample that does not fit closes the row and starts the next."""
    row: list[Encoded] = []
    used = 0
    for sample in samples:
        if row and used + len(sample) > max_seq_len:
            yield make_row(row, max_seq_len, pad_id)
            row, used = [], 0
        row.append(sample)
        used += len(sample)
    if row:
        yield make_row(row, max_seq_len, pad_id)


def make_row(docs: list[Encoded], length: int, pad_id: int) -> Row:
    ids = np.full(length, pad_id, np.int64)
    labels = np.full(length, IGNORE_INDEX, np.int64)
    scored = np.zeros(length, np.int64)
    types = np.full(length, PAD_TYPE, np.int64)
    positions = np.zeros((length, 3), np.int64)
    doc_ids = np.full(length, len(docs), np.int64)
    start = 0
    for d, doc in enumerate(docs):
        end = start + len(doc)
        ids[start:end] = doc.input_ids
        # The label at position i is token i + 1 when that token is trained on; a document's last position has none.
        nxt = np.where(doc.target[1:], doc.input_ids[1:], IGNORE_INDEX)
        labels[start: end - 1] = nxt
        scored[start: end - 1] = doc.scored[1:]
        types[start:end] = doc.token_type_ids
        positions[start:end] = doc.position_ids
        doc_ids[start:end] = d
        start = end
    patches = [p for doc in docs for p in doc.patches]
    grids = [g for doc in docs for g in doc.grids]
    return Row(ids, labels, scored, types, positions, doc_ids, patches, grids)
