"""What the data pipeline hands the model: one micro-batch, and the label value that carries no loss."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import paddle

IGNORE_INDEX = -100  # a label position that is not trained on (prompts, images, padding)
# a preference pair's row: its ``objective_inputs[PAIR_SIDES]``, CHOSEN and REJECTED on its two answers' positions
# (0: the shared prompt, padding)
PAIR_SIDES = "pair_sides"
CHOSEN, REJECTED = 1, 2


def rows_with_pairs(labels: np.ndarray, pair_sides: np.ndarray) -> np.ndarray:
    """``[rows]``: whether each row holds a preference pair whose two answers both have trained tokens (a filler row
    of a short batch has none)."""
    trained = labels != IGNORE_INDEX
    return np.logical_and(*((trained & (pair_sides == side)).any(axis=1) for side in (CHOSEN, REJECTED)))


@dataclass(frozen=True)
class HostCounts:
    """What a step must know of a micro-batch before it runs (the loss's denominator, the throughput, the FLOPs),
    counted from the host arrays before they are copied to the device, so that no one reads them back."""

    label_tokens: int  # positions with a label
    text_tokens: int
    vision_tokens: int  # image and video tokens
    answers: int  # rows with at least one label (an RL batch's sampled answers)
    pairs: int | None = None  # rows holding a preference pair whose two answers both have trained tokens
    # labels_ahead[k - 1]: the labels at least k positions into their document, which multi-token prediction's
    # depth k trains on (model.mtp.labels_ahead)
    labels_ahead: tuple[int, ...] = ()

    @classmethod
    def of(cls, labels: np.ndarray, token_type_ids: np.ndarray, pair_sides: np.ndarray | None = None,
           key_ends: np.ndarray | None = None, depths: int = 0) -> HostCounts:
        """``key_ends``: the batch's (``Batch.key_ends``), whose runs of one value are its documents, and ``depths``:
        how many entries of ``labels_ahead`` to count."""
        pairs = None if pair_sides is None else int(rows_with_pairs(labels, pair_sides).sum())
        labelled = labels != IGNORE_INDEX
        ahead = _labels_ahead(labelled, key_ends, depths) if depths else ()
        return cls(int(labelled.sum()), int((token_type_ids == 0).sum()), int((token_type_ids >= 1).sum()),
                   int(labelled.any(axis=1).sum()), pairs, ahead)

    @property
    def tokens(self) -> int:
        """Text and image tokens (not padding)."""
        return self.text_tokens + self.vision_tokens


def _labels_ahead(labelled: np.ndarray, key_ends: np.ndarray | None, depths: int) -> tuple[int, ...]:
    """Labelled positions at least k positions into their document, for k = 1 .. ``depths`` (without
    ``key_ends``, each row is one document)."""
    positions = np.broadcast_to(np.arange(labelled.shape[1]), labelled.shape)
    first = np.zeros_like(labelled)
    first[:, 0] = True
    if key_ends is not None:
        first[:, 1:] = key_ends[:, 1:] != key_ends[:, :-1]  # a document's first position: the key end changes
    into_document = positions - np.maximum.accumulate(np.where(first, positions, 0), axis=1)
    return tuple(int((labelled & (into_document >= k)).sum()) for k in range(1, depths + 1))


@dataclass
class Batch:
    """One micro-batch. ``token_type_ids``: 0 text, 1 image, 2 video, -1 padding."""

    input_ids: paddle.Tensor  # [batch, seq] int64
    labels: paddle.Tensor  # [batch, seq] int64, next token or IGNORE_INDEX
    token_type_ids: paddle.Tensor  # [batch, seq] int64
    position_ids: paddle.Tensor  # [batch, seq, 3] int64 (t, h, w)
    key_ends: paddle.Tensor  # [batch, seq] int64, the first position that no longer sees each key (model.attention)
    pixel_patches: paddle.Tensor  # [patches, channels * patch * patch] float32
    grid_thw: np.ndarray  # [images, 3] patches per image along t, h, w
    # what the objective reads besides the labels, by name (objectives.Objective.input_names): a preference
    # pair's sides and its reference's log-probabilities, a sampled answer's advantage and its sampler's
    # log-probabilities, ... (each objective's module says what they hold)
    objective_inputs: dict[str, paddle.Tensor] = field(default_factory=dict)
    row_keys: np.ndarray | None = None  # each row's key in its data, where figures are kept per row (a pair's key)
    # the experts each token went to when it was sampled [batch, moe layers, seq, k] (moe.replay; None without
    # router replay)
    routes: paddle.Tensor | None = None
    counts: HostCounts | None = None  # counted by ``collate``; None in a batch made by hand

    def host_counts(self) -> HostCounts:
        """The batch's counts; a batch made without them counts its tensors (reading them back), but for
        ``labels_ahead``: multi-token prediction trains on collated batches (``data.collate``)."""
        if self.counts is None:
            given = self.objective_inputs.get(PAIR_SIDES)
            sides = None if given is None else given.numpy()
            return HostCounts.of(self.labels.numpy(), self.token_type_ids.numpy(), sides)
        return self.counts
