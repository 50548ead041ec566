"""The record every data source yields: images plus a sequence of text and image chunks."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class Chunk:
    text: str = ""  # text of this chunk, or "" for an image
    image: int = -1  # index into Sample.images, or -1 for text
    loss: bool = False  # train on these tokens
    scored: str = ""  # caption-accuracy category of these tokens (words only the image tells), "" = none


@dataclass
class Sample:
    images: list[np.ndarray] = field(default_factory=list)  # HxWxC uint8
    chunks: list[Chunk] = field(default_factory=list)
