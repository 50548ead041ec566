"""Over-long videos kept, not skipped: a sample whose videos take it past ``max_seq_len`` gets smaller frames, then
fewer frames, until it fits.

1. The frame size: one budget for every video frame of the sample (ERNIE's largest pixels per frame, or the
   longest side under ``data.max_image_side``), the largest in whole steps (a merge block's pixels, or its side)
   between the configured floor and the configured size at which the sample fits. Tokens only fall as the
   budget does, so bisection finds it.
2. Then, if the floor is still too long, frames: the video keeping the most frames gives up one adapter step
   (``temporal`` frames) at a time, its kept frames spread evenly over the sampled ones with the first and the
   last always kept, until the sample fits or every video is down to one step.

Token counts come from the frame sizes alone, so the search encodes nothing; the encoder encodes the sample once
with the budget and frames chosen. A sample that still does not fit goes on to ``data.overlong``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np


@dataclass
class VideoFit:
    budget: int  # frame budget chosen (pixels, or the longest side)
    frames: list[np.ndarray]  # indices of the sampled frames each video keeps
    shrunk: int  # videos whose frames got smaller
    dropped: int  # frames dropped, over every video


def kept_frames(count: int, keep: int) -> np.ndarray:
    """``keep`` of ``count`` frames, evenly spread, the first and the last among them."""
    return np.round(np.linspace(0, count - 1, keep)).astype(np.int64) if keep > 1 else np.zeros(1, np.int64)


def fit_videos(other_tokens: int, frames: list[tuple[int, int, int]], limit: int, size_at: Callable,
               budgets: list[int], block: int, temporal: int) -> VideoFit | None:
    """The budget and frames that fit ``limit`` tokens, None when even one step of each video at the floor is
    too long. ``other_tokens``: the sample's tokens besides the videos' placeholders; ``frames``: (count, height,
    width) of each video's sampled frames; ``size_at(height, width, budget)``: a frame's size under a budget;
    ``budgets``: the budgets to search, ascending, the configured one last; ``block``: the side of one
    placeholder token's pixels (patch x merge)."""

    def placeholders(budget: int) -> list[int]:
        """One adapter step's tokens of each video under ``budget``."""
        return [int(np.prod(size_at(h, w, budget))) // block ** 2 for _, h, w in frames]

    def tokens(steps: list[int], kept: list[int]) -> int:
        return other_tokens + sum(-(-k // temporal) * step for k, step in zip(kept, steps))

    counts = [count for count, _, _ in frames]
    low, high = 0, len(budgets) - 1  # the largest budget that fits, by bisection
    if tokens(placeholders(budgets[low]), counts) <= limit:
        while low < high:
            middle = (low + high + 1) // 2
            fits = tokens(placeholders(budgets[middle]), counts) <= limit
            low, high = (middle, high) if fits else (low, middle - 1)
    budget, steps = budgets[low], placeholders(budgets[low])
    kept = list(counts)
    while tokens(steps, kept) > limit:
        longest = int(np.argmax(kept))
        if kept[longest] <= temporal:
            return None
        kept[longest] = max(kept[longest] - temporal, temporal)  # two frames at least: the first and the last
    shrunk = sum(now < before for now, before in zip(steps, placeholders(budgets[-1])))
    return VideoFit(budget, [kept_frames(count, k) for count, k in zip(counts, kept)], shrunk,
                    sum(counts) - sum(kept))
