"""What the data pipeline hands the model: one micro-batch, and the label value that carries no loss."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import paddle

IGNORE_INDEX = -100  # a label position that is not trained on (prompts, images, padding)


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
    # preference pairs (training.stage: dpo): each row one pair, its positions marked 1 (chosen answer), 2
    # (rejected answer) or 0 (the shared prompt, padding); the reference model's log-probabilities of both
    # answers [batch, 2], once its pass has run (training.preference)
    pair_sides: paddle.Tensor | None = None
    reference_logps: paddle.Tensor | None = None
    pair_keys: np.ndarray | None = None  # each row's pair's key (data.packing.Row.pair_key)
