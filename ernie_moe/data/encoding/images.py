"""Image preprocessing: resize to whole merge blocks, normalise, cut into flattened patches."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from PIL import Image

MEAN = np.array([0.48145466, 0.4578275, 0.40821073], np.float32)
STD = np.array([0.26862954, 0.26130258, 0.27577711], np.float32)


def fit_size(height: int, width: int, unit: int, max_side: int) -> tuple[int, int]:
    """Nearest size whose sides are multiples of ``unit`` with the longest side at most ``max_side``."""
    scale = min(1.0, max_side / max(height, width))

    def snap(side):
        return max(unit, int(round(side * scale / unit)) * unit)

    return snap(height), snap(width)


MAX_ASPECT = 200  # ERNIE's limit on height / width


def pixel_budget_size(height: int, width: int, unit: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """ERNIE-4.5-VL's resize rule: sides the nearest multiples of ``unit`` (28), then scaled, keeping the aspect,
    into ``[min_pixels, max_pixels]`` (rounding down when shrinking, up when growing); an aspect above 200 is
    first cut to 200."""
    if max(height, width) / min(height, width) > MAX_ASPECT:
        if height > width:
            width = max(unit, round(width / unit) * unit)
            height = math.floor(width * MAX_ASPECT / unit) * unit
        else:
            height = max(unit, round(height / unit) * unit)
            width = math.floor(height * MAX_ASPECT / unit) * unit
    h, w = max(unit, round(height / unit) * unit), max(unit, round(width / unit) * unit)
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h, w = math.floor(height / beta / unit) * unit, math.floor(width / beta / unit) * unit
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h, w = math.ceil(height * beta / unit) * unit, math.ceil(width * beta / unit) * unit
    return h, w


def target_size(height: int, width: int, unit: int, max_side: int,
                pixel_budget: tuple[int, int] | None = None) -> tuple[int, int]:
    """The size :func:`prepare` resizes to: the longest side at most ``max_side``, or with ``pixel_budget`` (min,
    max pixels) ERNIE's rule (:func:`pixel_budget_size`)."""
    if pixel_budget is not None:
        return pixel_budget_size(height, width, unit, *pixel_budget)
    return fit_size(height, width, unit, max_side)


def prepare(image: np.ndarray, unit: int, max_side: int, pixel_budget: tuple[int, int] | None = None) -> np.ndarray:
    """uint8 HxWxC -> float32 HxWxC normalised, sides a multiple of ``unit``, at :func:`target_size`."""
    h, w = target_size(image.shape[0], image.shape[1], unit, max_side, pixel_budget)
    if (h, w) != image.shape[:2]:
        image = np.asarray(Image.fromarray(image).resize((w, h), Image.Resampling.BICUBIC))
    return (image.astype(np.float32) / 255.0 - MEAN) / STD


def patchify(image: np.ndarray, patch: int, merge: int) -> tuple[np.ndarray, np.ndarray]:
    """HxWxC -> (patches ``[h*w, C*patch*patch]`` in merge-block order, grid ``[1, h, w]``)."""
    height, width, channels = image.shape
    gh, gw = height // patch, width // patch
    x = image.transpose(2, 0, 1).reshape(channels, gh // merge, merge, patch, gw // merge, merge, patch)
    x = x.transpose(1, 4, 2, 5, 0, 3, 6)  # block row, block col, row in block, col in block, C, p, p
    return x.reshape(gh * gw, channels * patch * patch), np.array([1, gh, gw], np.int64)


def video_frames(frames: Sequence | np.ndarray, temporal: int) -> list:
    """A video's frames (or anything standing for them), the last repeated until their number is a multiple of
    ``temporal`` (ERNIE's rule: the adapter merges frames in pairs)."""
    kept = list(frames)
    return kept + kept[-1:] * (-len(kept) % temporal)
