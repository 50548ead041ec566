"""Samples -> token sequences -> packed rows -> model batches.

A row holds whole samples back to back (each its own attention document) up to ``max_seq_len``.
Rows come out in an order fixed by the sample order alone, so any number of ranks can cut the same
global batch out of the same row stream.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from ...batch import IGNORE_INDEX
from ...config.schema import ModelConfig
from ..formats.chat import chat_format
from ..formats.sample import BadSample, Chunk, Sample, is_unread
from .images import patchify, prepare, target_size, video_frames
from .tokenizer import END_OF_SENTENCE, Tokenizer
from .video_fit import VideoFit, fit_videos

PAD_TYPE = -1
VIDEO_TYPE = 2  # a video's placeholder tokens (an image's are 1)
# data statistics that count what was changed to fit, not samples skipped
FIT_COUNTS = ("shrunk_videos", "dropped_frames")
# Caption-accuracy categories a data source may mark its words with.
SCORE_CATEGORIES = ("color", "shape", "row", "column")


def score_category(name: str) -> int:
    return SCORE_CATEGORIES.index(name) + 1 if name else 0


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
    """Samples -> token ids, trained-token mask, token types and 3D positions, ERNIE's way.

    An image is ``(h/2)(w/2)`` placeholder tokens after the 2x2 merge (a video ``t/2`` times that, token type
    2), their positions ``(start + frame, start + row, start + column)`` on the merged grid, after which text
    continues at the largest + 1. With ERNIE's tokenizer each image sits between ``<|IMAGE_START|>`` and
    ``<|IMAGE_END|>`` (a video between the video markers), each of token type 1 and a position of its own.
    """

    def __init__(self, tokenizer: Tokenizer, model_cfg: ModelConfig, max_seq_len: int, overlong: str,
                 max_image_side: int,
                 stats: Counter,
                 pixel_budget: tuple[int, int] | None = None, video_budget: tuple[int, int] | None = None):
        """``pixel_budget``: (min, max) pixels of an image after ERNIE's resize, ``video_budget`` of a video
        frame; None: ``max_image_side``."""
        self.tok = tokenizer
        self.chat = chat_format(tokenizer)
        if pixel_budget is None and max_image_side < 1:
            raise ValueError("an encoder needs an image rule: a pixel budget, or a longest side of at least 1")
        self.pixel_budget, self.video_budget = pixel_budget, video_budget or pixel_budget
        v = model_cfg.vision_config
        self.patch, self.merge, self.temporal = v.patch_size, v.spatial_merge_size, model_cfg.temporal_conv_size
        self.max_seq_len, self.overlong, self.max_side = max_seq_len, overlong, max_image_side
        self.stats = stats
        self.brackets = {kind: (tokenizer.token_id(f"<|{kind}_START|>"), tokenizer.token_id(f"<|{kind}_END|>"))
                         for kind in ("IMAGE", "VIDEO")}

    def identity(self) -> dict:
        """The settings a sample's encoding depends on (what a length index is kept under)."""
        return {"tokenizer": self.tok.identity(), "chat": type(self.chat).__name__, "patch": [self.patch, self.merge,
                self.temporal], "max_seq_len": self.max_seq_len, "overlong": self.overlong, "max_side": self.max_side,
                "budgets": [self.pixel_budget, self.video_budget], "brackets": self.brackets}

    def __call__(self, sample: Sample) -> Encoded:
        """A training sample: the prompt, its trained tokens and the end-of-sentence token closing them, fitted to
        ``max_seq_len``: over-long videos shrunk (``data.encoding.video_fit``), then as ``data.overlong`` says."""
        e = self.whole(sample)
        if len(e) > self.max_seq_len and sample.videos:
            fit = self._video_fit(sample, e)
            if fit is not None:
                e = self.whole(sample, fit)
                self.stats["shrunk_videos"] += fit.shrunk
                self.stats["dropped_frames"] += fit.dropped
        return self._fit(e)

    def _video_fit(self, sample: Sample, e: Encoded) -> VideoFit | None:
        """The frame budget and frames of ``sample``'s videos that fit ``max_seq_len`` (``data.encoding.video_fit``)."""
        unit = self.patch * self.merge
        if self.video_budget is not None:  # ERNIE's rule: the most pixels of a frame, in merge blocks
            low, high = self.video_budget
            budgets = [*range(low, high, unit * unit), high]
        else:  # the longest side, in merge blocks
            budgets = [*range(unit, self.max_side, unit), self.max_side]

        def size_at(height, width, budget):
            return target_size(height, width, unit, *self._video_resize(budget))

        frames = [(len(video), video.shape[1], video.shape[2]) for video in sample.videos]
        video_tokens = int((e.token_type_ids == VIDEO_TYPE).sum())
        return fit_videos(len(e) - video_tokens, frames, self.max_seq_len, size_at, budgets, unit, self.temporal)

    def _video_resize(self, budget: int | None) -> tuple[int, tuple[int, int] | None]:
        """(longest side, pixel budget) a video frame is prepared at under a fit's frame ``budget`` (None: as
        configured): the budget replaces the configured most pixels, or the longest side."""
        if budget is None:
            return self.max_side, self.video_budget
        if self.video_budget is None:
            return budget, None
        return self.max_side, (self.video_budget[0], budget)

    def whole(self, sample: Sample, fit: VideoFit | None = None) -> Encoded:
        """A training sample, whatever its length; ``fit``: its videos' frame budget and kept frames."""
        chunks, closed = self._chunks(sample, open_turn=False)
        e = self._encode(sample, chunks, begin=not closed, fit=fit)
        if not e.target.any():
            raise BadSample("empty_text", "sample has no text to train on")
        if not closed:
            next_position = e.position_ids[-1].max() + 1
            e = Encoded(np.append(e.input_ids, self.tok.eos_id), np.append(e.target, True), np.append(e.scored, 0),
                        np.append(e.token_type_ids, 0), np.vstack([e.position_ids, [[next_position] * 3]]),
                        e.patches, e.grids)
        return e

    def prompt(self, sample: Sample) -> Encoded:
        """The sample's tokens from the beginning-of-sentence token on, a conversation ending with the
        assistant's turn opened: what generation continues."""
        chunks, closed = self._chunks(sample, open_turn=True)
        return self._encode(sample, chunks, begin=not closed)

    def _chunks(self, sample: Sample, open_turn: bool) -> tuple[list[Chunk], bool]:
        """The sample's chunks, and whether they hold their own begin and end tokens."""
        if sample.conversation is None:
            if sample.closed and self.tok.token_id(END_OF_SENTENCE) is None:
                raise BadSample("needs_ernie_tokenizer", "ERNIEKit records are written with ERNIE's special tokens, "
                                                         "which this tokenizer does not have")
            return sample.chunks, sample.closed
        return self.chat.chunks(sample.conversation, open_turn=open_turn), self.chat.closed

    def _encode(self, sample: Sample, chunks: list[Chunk], begin: bool, fit: VideoFit | None = None) -> Encoded:
        ids, target, scored, types, positions = [], [], [], [], []
        patches, grids = [], []

        def add(token: int, token_type: int, position, trained: bool = False, category: int = 0):
            ids.append(token)
            types.append(token_type)
            positions.append(position)
            target.append(trained)
            scored.append(category)

        if begin:
            add(self.tok.bos_id, 0, (0, 0, 0))
        for chunk in chunks:
            pos = max(positions[-1]) + 1 if positions else 0
            if chunk.image >= 0 or chunk.video >= 0:
                video = chunk.video >= 0
                flat, grid = self._visual(sample, chunk, fit)
                patches.append(flat)
                grids.append(grid)
                start, end = self.brackets["VIDEO" if video else "IMAGE"]
                if start is not None:
                    add(start, 1, (pos,) * 3)
                    pos += 1
                t = -(-int(grid[0]) // self.temporal)
                for tt, hh, ww in np.ndindex(t, grid[1] // self.merge, grid[2] // self.merge):
                    add(self.tok.image_token_id, VIDEO_TYPE if video else 1, (pos + tt, pos + hh, pos + ww))
                if end is not None:
                    add(end, 1, (max(positions[-1]) + 1,) * 3)
                continue
            category = score_category(chunk.scored)
            if chunk.trained_bytes is None:
                for offset, token in enumerate(self.tok.encode(chunk.text)):
                    add(token, 0, (pos + offset,) * 3, chunk.loss, category)
                continue
            for offset, (token, first, end) in enumerate(self.tok.encode_with_offsets(chunk.text)):
                trained = any(first < e and end > b for b, e in chunk.trained_bytes)
                add(token, 0, (pos + offset,) * 3, trained, category)
        return Encoded(np.array(ids, np.int64), np.array(target, bool), np.array(scored, np.int64),
                       np.array(types, np.int64), np.array(positions, np.int64).reshape(-1, 3), patches, grids)

    def _visual(self, sample: Sample, chunk: Chunk, fit: VideoFit | None) -> tuple[np.ndarray, np.ndarray]:
        """An image's or a video's patches in merge-block order, frame after frame, and its (t, h, w) grid; a
        video's frames and their size as ``fit`` chose them."""
        unit = self.patch * self.merge
        if chunk.image >= 0:
            image = sample.images[chunk.image]
            if is_unread(image):
                return self._grid_only(1, image.shape[:2], self.max_side, self.pixel_budget)
            return patchify(prepare(image, unit, self.max_side, self.pixel_budget), self.patch, self.merge)
        video = sample.videos[chunk.video]
        if fit is not None:
            video = video[fit.frames[chunk.video]]
        side, budget = self._video_resize(fit.budget if fit is not None else None)
        if is_unread(video):
            return self._grid_only(len(video_frames(range(len(video)), self.temporal)), video.shape[1:3], side, budget)
        frames = [patchify(prepare(frame, unit, side, budget), self.patch, self.merge)
                  for frame in video_frames(video, self.temporal)]
        grid = frames[0][1].copy()
        grid[0] = len(frames)
        return np.concatenate([f for f, _ in frames]), grid

    def _grid_only(self, frames: int, size, side: int, budget) -> tuple[np.ndarray, np.ndarray]:
        """No patches, and the (t, h, w) grid the image's or video's pixels would give."""
        height, width = size
        h, w = target_size(height, width, self.patch * self.merge, side, budget)
        return np.zeros([0, 3 * self.patch * self.patch], np.float32), np.array([frames, h // self.patch,
                                                                                 w // self.patch], np.int64)

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


def split_answer(encoded: Encoded) -> tuple[Encoded, np.ndarray, np.ndarray] | None:
    """(prompt, answer ids, their categories) of a training encoding: the answer is its last run of trained
    tokens without the closing end-of-sentence token; None when an image or video follows the answer's start."""
    trained = np.flatnonzero(encoded.target)
    end = int(trained[-1]) + 1
    start = end
    while start > 0 and encoded.target[start - 1]:
        start -= 1
    if (encoded.token_type_ids[start:] != 0).any():
        return None
    e = encoded
    prompt = Encoded(e.input_ids[:start], e.target[:start], e.scored[:start], e.token_type_ids[:start],
                     e.position_ids[:start], e.patches, e.grids)
    return prompt, e.input_ids[start:end], e.scored[start:end]


@dataclass
class Row:
    """One packed sequence as numpy arrays (see :class:`ernie_moe.model.Batch` for the fields)."""

    input_ids: np.ndarray
    labels: np.ndarray
    scored: np.ndarray
    token_type_ids: np.ndarray
    position_ids: np.ndarray
    doc_ids: np.ndarray  # the packed document of each position (padding: one more)
    key_ends: np.ndarray  # the first position that no longer sees each position's key (nn.flashmask.RowBounds)
    patches: list[np.ndarray]
    grids: list[np.ndarray]
    # the objective's inputs of this row by its input names (objectives.Objective.input_names: a preference pair's
    # sides, a sampled answer's advantage and its sampler's log-probabilities, ...), each stacked over the rows by
    # ``collate`` into ``Batch.objective_inputs``; every row of a batch carries the same names
    inputs: dict[str, np.ndarray] = field(default_factory=dict)
    key: int = 0  # the row's sample index in its data set (held out: -1 - index), for figures kept per row
    routes: np.ndarray | None = None  # the experts each token went to when sampled ([moe layers, seq, k], moe.replay)

    def unpadded(self) -> Encoded:
        """The row's tokens before its padding as one encoded sample (the trained tokens those with a label)."""
        n = int((self.token_type_ids != PAD_TYPE).sum())
        target = np.append(False, self.labels[: n - 1] != IGNORE_INDEX)
        return Encoded(self.input_ids[:n], target, self.scored[:n], self.token_type_ids[:n], self.position_ids[:n],
                       self.patches, self.grids)


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
    return Row(ids, labels, scored, types, positions, doc_ids, document_ends(doc_ids), patches, grids)


def _document_runs(doc_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(first, end) position of each document (``doc_ids`` runs of one id each)."""
    starts = np.flatnonzero(np.diff(doc_ids, prepend=doc_ids[0] - 1))
    return starts, np.append(starts[1:], len(doc_ids))


def document_ends(doc_ids: np.ndarray) -> np.ndarray:
    """Each position's key is seen up to the end of its document."""
    starts, ends = _document_runs(doc_ids)
    return np.repeat(ends, ends - starts).astype(np.int64)


def document_starts(doc_ids: np.ndarray) -> np.ndarray:
    """Each position's document's first position: from there on its key is seen, attending both ways."""
    starts, ends = _document_runs(doc_ids)
    return np.repeat(starts, ends - starts).astype(np.int64)
