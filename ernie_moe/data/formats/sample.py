"""The record every data source yields: images plus a sequence of text and image chunks."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


class DataError(ValueError):
    """Data the trainer cannot use at all (individual bad samples are skipped and counted instead)."""


# what to do when every sample was skipped for one of these reasons
SKIP_FIXES = {
    "needs_ernie_tokenizer": "ERNIEKit's records are written with ERNIE's special tokens: train from an ERNIE 4.5 "
                             "model folder (training.model_name_or_path, whose tokenizer is used), name an ERNIE "
                             "4.5 tokenizer folder in data.tokenizer_path (model.vocab_size its vocabulary), or try "
                             "them on a model built here, whose tokenizer reads bytes and ERNIE's pieces: "
                             "data.tokenizer_path=configs/tokenizers/ernie_bytes",
    "missing_image": "image paths are read relative to the data file; check that they exist there",
    "bad_json": "each line of a JSONL file must be one JSON object",
}


def no_usable_sample(skipped: dict) -> DataError:
    """The error of data whose every sample was skipped, with the fix for the reasons that have one."""
    most_first = sorted(skipped, key=lambda reason: skipped[reason], reverse=True)
    fixes = [SKIP_FIXES[reason] for reason in most_first if reason in SKIP_FIXES]
    return DataError(f"the training data has no usable sample (skipped: {skipped or 'nothing; the data set is empty'})"
                     + (f". {'; '.join(fixes)}." if fixes else "."))


class BadSample(Exception):
    """A sample that cannot be used; ``reason`` is the counter it is reported under."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(detail or reason)
        self.reason = reason


@dataclass
class Chunk:
    text: str = ""  # text of this chunk, or "" for an image
    image: int = -1  # index into Sample.images, or -1
    video: int = -1  # index into Sample.videos, or -1
    loss: bool = False  # train on these tokens
    trained_bytes: list[tuple[int, int]] | None = None  # or on the tokens overlapping these byte spans of text
    scored: str = ""  # caption-accuracy category of these tokens (words only the image tells), "" = none


@dataclass
class Sample:
    images: list[np.ndarray] = field(default_factory=list)  # HxWxC uint8
    chunks: list[Chunk] = field(default_factory=list)
    videos: list[np.ndarray] = field(default_factory=list)  # TxHxWxC uint8 frames
    conversation: object = None  # data.formats.chat.Conversation: the encoder's chat format makes the chunks
    closed: bool = False  # the chunks hold the begin and end tokens themselves (ERNIE's special tokens)


def unread(shape) -> np.ndarray:
    """An image (``[H, W, 3]``) or video (``[T, H, W, 3]``) whose pixels were not read, only its size: no memory
    behind it. The encoder gives such an image its tokens and grid, without patches (the packing plan's lengths)."""
    return np.broadcast_to(np.zeros((), np.uint8), tuple(shape))


def is_unread(image: np.ndarray) -> bool:
    return image.size > 0 and not any(image.strides)
