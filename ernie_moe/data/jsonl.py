"""Real data: one JSON object per line, with image paths relative to the file.

Two record shapes are accepted::

    {"image": "cat.jpg", "text": "a cat on a mat"}                       # caption (or "images": [...])
    {"images": ["a.jpg"], "messages": [{"role": "user", "content": "<image>\\nWhat is this?"},
                                       {"role": "assistant", "content": "A cat."}]}

Only caption text and assistant turns are trained on. ``<image>`` marks where each image goes in a
chat; images without a marker go before the first turn. A message's content may also be a list of parts, as
PaddleFormers and Hugging Face chat messages are written: ``{"type": "text", "text": ...}``,
``{"type": "image", "image": "a.jpg"}`` or ``{"type": "image_url", "image_url": {"url": "a.jpg"}}``; the
images are then those of the parts, in order.
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
    def __init__(self, path: str, max_pixels: int = 50_000_000):
        self.path = Path(path)
        self.max_pixels = max_pixels
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
        if not isinstance(paths, list) or not all(isinstance(p, str) for p in paths):
            raise BadSample("bad_images", f"line {index + 1}: images must be a path or a list of paths, not {paths!r}")
        messages = record.get("messages")
        if isinstance(messages, list) and any(isinstance(m, dict) and isinstance(m.get("content"), list)
                                              for m in messages):
            if "images" in record or "image" in record:
                raise BadSample("bad_images", f"line {index + 1}: images given both as content parts and as a list")
            messages, paths = flatten_parts(messages)
        images = [self._load_image(p) for p in paths]
        if "messages" in record:
            chunks = chat_chunks(messages, len(images))
        else:
            text = record.get("text", "")
            if not isinstance(text, str) or not text.strip():
                raise BadSample("empty_text", f"line {index + 1} has no text")
            chunks = [Chunk(image=i) for i in range(len(images))] + [Chunk(text=text.strip(), loss=True)]
        return Sample(images=images, chunks=chunks)

    def _load_image(self, relative) -> np.ndarray:
        return load_image(self.root / str(relative), self.max_pixels)


def load_image(path: Path, max_pixels: int) -> np.ndarray:
    """An image file as RGB ``uint8 [H, W, 3]``; BadSample when it is missing, too large or undecodable."""
    if not path.is_file():
        raise BadSample("missing_image", f"image '{path}' does not exist")
    try:
        with Image.open(path) as image:  # reads the header only: the size is known before decoding
            width, height = image.size
            if width * height > max_pixels:
                raise BadSample("image_too_large", f"image '{path}' has {width} x {height} pixels, more than "
                                                   f"data.max_image_pixels ({max_pixels})")
            return np.asarray(image.convert("RGB"))
    except Image.DecompressionBombError as err:  # Pillow's own cap, met before ours in the header
        raise BadSample("image_too_large", f"image '{path}': {err}") from None
    except (UnidentifiedImageError, OSError, ValueError) as err:
        raise BadSample("corrupt_image", f"image '{path}' cannot be decoded: {err}") from None


def flatten_parts(messages: list) -> tuple[list, list[str]]:
    """Messages whose content is a list of parts as string contents with ``<image>`` markers, and the parts'
    image paths in order; an unknown part is a BadSample (``bad_message``), a video one too (not read yet)."""
    flat, paths = [], []
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            flat.append(message)
            continue
        text = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text" and isinstance(part.get("text"), str):
                text.append(part["text"])
            elif kind in ("image", "image_url"):
                source = part.get("image") or part.get("path") or part.get("url") or part.get("image_url")
                source = source.get("url") if isinstance(source, dict) else source
                if not isinstance(source, str):
                    raise BadSample("bad_message", f"image part {part!r} names no image file")
                text.append(IMAGE_MARK)
                paths.append(source)
            elif kind == "video":
                raise BadSample("video_unsupported", "video parts are not read in this release")
            else:
                raise BadSample("bad_message", f"unknown content part {part!r} (text, image or image_url)")
        flat.append({**message, "content": "".join(text)})
    return flat, paths


def chat_chunks(messages, num_images: int, open_turn: bool = False) -> list[Chunk]:
    """A conversation as chunks, assistant text trained on. ``open_turn`` (a prompt to generate from): the
    conversation ends with the assistant's prefix and needs no assistant text."""
    if not isinstance(messages, list) or not messages:
        raise BadSample("empty_text", "messages is empty")
    for message in messages:
        if not isinstance(message, dict) or message.get("role") not in ROLE_PREFIX:
            raise BadSample("bad_message", f"message {message!r} needs a role of {', '.join(ROLE_PREFIX)}")
        if not isinstance(message.get("content"), str):
            raise BadSample("bad_message", f"the content of a {message['role']} message must be a string, not "
                                           f"{message.get('content')!r}")
    marks = sum(m["content"].count(IMAGE_MARK) for m in messages)
    if marks > num_images:
        raise BadSample("image_count_mismatch", f"{marks} {IMAGE_MARK} markers but {num_images} images")
    chunks = [Chunk(image=i) for i in range(num_images - marks)]
    image = num_images - marks
    for message in messages:
        trained = message["role"] == "assistant"
        chunks.append(Chunk(text=("\n" if len(chunks) else "") + ROLE_PREFIX[message["role"]]))
        for i, text in enumerate(message["content"].split(IMAGE_MARK)):
            if i:
                chunks.append(Chunk(image=image))
                image += 1
            if text:
                chunks.append(Chunk(text=text, loss=trained))
    if open_turn:
        return chunks + [Chunk(text="\n" + ROLE_PREFIX["assistant"])]
    if not any(c.loss and c.text.strip() for c in chunks):
        raise BadSample("empty_text", "no assistant text to train on")
    return chunks
