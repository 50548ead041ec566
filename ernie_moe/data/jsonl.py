"""Real data: one JSON object per line, with image paths relative to the file.

Two record shapes are accepted::

    {"image": "cat.jpg", "text": "a cat on a mat"}                       # caption (or "images": [...])
    {"images": ["a.jpg"], "messages": [{"role": "user", "content": "<image>\\nWhat is this?"},
                                       {"role": "assistant", "content": "A cat."}]}

Only caption text and assistant turns are trained on. ``<image>`` marks where each image goes in a
chat; images without a marker go before the first turn.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from PIL import Image, UnidentifiedImageError

from .packing import BadSample
from .sample import Chunk, Sample

IMAGE_MARK = "<image>"
ROLE_PREFIX = {"system": "System: ", "user": "User: ", "assistant": "Assistant: "}


class JsonlDataset:
    def __init__(self, path: str):
        self.path = Path(path)
        self.root = self.path.parent
        self.offsets = []
        with open(self.path, "rb") as f:
            offset = 0
            for line in f:
                if line.strip():
                    self.offsets.append(offset)
                offset += len(line)

    def __len__(self) -> int:
        return len(self.offsets)

    def _line(self, index: int) -> str:
        with open(self.path, "rb") as f:
            f.seek(self.offsets[index])
            return f.readline().decode("utf-8", errors="replace")

    def __getitem__(self, index: int) -> Sample:
        try:
            record = json.loads(self._line(index))
        except json.JSONDecodeError as err:
            raise BadSample("bad_json", f"line {index + 1}: {err}") from None
        if not isinstance(record, dict):
            raise BadSample("bad_json", f"line {index + 1} is not a JSON object")
        paths = record.get("images", [record["image"]] if "image" in record else [])
        if isinstance(paths, str):
            paths = [paths]
        images = [self._load_image(p) for p in paths]
        if "messages" in record:
            chunks = self._chat_chunks(record["messages"], len(images))
        else:
            text = record.get("text", "")
            if not isinstance(text, str) or not text.strip():
                raise BadSample("empty_text", f"line {index + 1} has no text")
            chunks = [Chunk(image=i) for i in range(len(images))] + [Chunk(text=text.strip(), loss=True)]
        return Sample(images=images, chunks=chunks)

    def _load_image(self, relative) -> np.ndarray:
        path = self.root / str(relative)
        if not path.is_file():
            raise BadSample("missing_image", f"image '{path}' does not exist")
        try:
            with Image.open(path) as image:
                return np.asarray(image.convert("RGB"))
        except (UnidentifiedImageError, OSError, ValueError) as err:
            raise BadSample("corrupt_image", f"image '{path}' cannot be decoded: {err}") from None

    @staticmethod
    def _chat_chunks(messages, num_images: int) -> list[Chunk]:
        if not isinstance(messages, list) or not messages:
            raise BadSample("empty_text", "messages is empty")
        marks = sum(str(m.get("content", "")).count(IMAGE_MARK) for m in messages if isinstance(m, dict))
        if marks > num_images:
            raise BadSample("image_count_mismatch", f"{marks} {IMAGE_MARK} markers but {num_images} images")
        chunks = [Chunk(image=i) for i in range(num_images - marks)]
        image = num_images - marks
        for message in messages:
            if not isinstance(message, dict) or message.get("role") not in ROLE_PREFIX:
                raise BadSample("bad_json", f"message {message!r} needs a role of {', '.join(ROLE_PREFIX)}")
            trained = message["role"] == "assistant"
            chunks.append(Chunk(text=("\n" if len(chunks) else "") + ROLE_PREFIX[message["role"]]))
            for i, text in enumerate(str(message.get("content", "")).split(IMAGE_MARK)):
                if i:
                    chunks.append(Chunk(image=image))
                    image += 1
                if text:
                    chunks.append(Chunk(text=text, loss=trained))
        if not any(c.loss and c.text.strip() for c in chunks):
            raise BadSample("empty_text", "no assistant text to train on")
        return chunks
