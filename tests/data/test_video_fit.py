"""Over-long videos shrunk, then thinned, to fit max_seq_len (``data.encoding.video_fit``), against the rule written out
here: the largest frame budget that fits, by a plain scan from the configured one down; then one adapter step of
frames at a time off the video keeping the most, its frames spread evenly with the first and last kept."""

import math
from collections import Counter

import numpy as np
import pytest

from ernie_moe.config import load_config
from ernie_moe.data import build_tokenizer
from ernie_moe.data.encoding.images import MEAN, STD, fit_size, pixel_budget_size
from ernie_moe.data.encoding.packing import Encoder
from ernie_moe.data.encoding.video_fit import fit_videos
from ernie_moe.data.formats.sample import BadSample, Chunk, Sample

BLOCK, TEMPORAL = 28, 2


def written_out(other, frames, limit, size_at, budgets):
    """(budget, kept frame indices of each video), or None: the rule, step by step."""

    def tokens(budget, kept):
        total = other
        for k, (_, h, w) in zip(kept, frames):
            height, width = size_at(h, w, budget)
            total += math.ceil(k / TEMPORAL) * (height // BLOCK) * (width // BLOCK)
        return total

    counts = [count for count, _, _ in frames]
    budget = budgets[0]
    for candidate in reversed(budgets):  # the configured budget first, then smaller ones
        if tokens(candidate, counts) <= limit:
            budget = candidate
            break
    kept = list(counts)
    while tokens(budget, kept) > limit:
        most = kept.index(max(kept))
        if kept[most] <= TEMPORAL:
            return None
        kept[most] = max(kept[most] - TEMPORAL, TEMPORAL)
    return budget, [np.round(np.linspace(0, c - 1, k)).astype(int) for c, k in zip(counts, kept)]


def test_the_fit_equals_the_rule_written_out():
    rng = np.random.default_rng(0)
    low, high = 64 * BLOCK ** 2, 400 * BLOCK ** 2
    budgets = [*range(low, high, BLOCK ** 2), high]

    def by_pixels(h, w, budget):
        return pixel_budget_size(h, w, BLOCK, low, budget)

    def by_side(h, w, side):
        return fit_size(h, w, BLOCK, side)

    shrunk = thinned = unfit = 0
    for case in range(300):
        frames = [(int(rng.integers(1, 40)), int(rng.integers(30, 900)), int(rng.integers(30, 900)))
                  for _ in range(int(rng.integers(1, 4)))]
        other, limit = int(rng.integers(0, 100)), int(rng.integers(20, 1500))
        size_at, scale = (by_pixels, budgets) if case % 2 else (by_side, [*range(8 * BLOCK, 896, BLOCK), 896])
        want = written_out(other, frames, limit, size_at, scale)
        got = fit_videos(other, frames, limit, size_at, scale, BLOCK, TEMPORAL)
        if want is None:
            assert got is None, (case, frames, limit)
            unfit += 1
            continue
        assert got.budget == want[0], (case, frames, limit)
        for kept, expected, (count, _, _) in zip(got.frames, want[1], frames):
            np.testing.assert_array_equal(kept, expected)
            assert kept[0] == 0 and kept[-1] == count - 1  # the first and last frames stay
        assert got.dropped == sum(c for c, _, _ in frames) - sum(len(k) for k in got.frames)
        shrunk += got.budget < scale[-1]
        thinned += got.dropped > 0
    assert shrunk > 50 and thinned > 20 and unfit > 5, (shrunk, thinned, unfit)  # each branch met


def video(frames, side):
    """Frames of one grey level each (frame i: 10 x i), so that the patches tell which frames were kept."""
    return np.stack([np.full((side, side, 3), 10 * i, np.uint8) for i in range(frames)])


def encoder(stats, limit, *overrides):
    cfg = load_config(None, ["data.image_max_pixels=50176", "data.image_min_pixels=3136", *overrides])
    return Encoder(build_tokenizer(cfg), cfg.model, limit, "skip", 448, stats, cfg.data.pixel_budget,
                   cfg.data.video_budget)


def kept_levels(encoded, grid_index):
    """The grey level of each frame of one encoded video, from its patches."""
    patches, grid = encoded.patches[grid_index], encoded.grids[grid_index]
    per_frame = int(grid[1] * grid[2])
    first_value = patches.reshape(int(grid[0]), per_frame, 3, -1)[:, 0, 0, 0]
    return np.round((first_value * STD[0] + MEAN[0]) * 255 / 10).astype(int).tolist()


def test_an_over_long_sample_keeps_its_videos_smaller_and_thinner_and_counts_them():
    sample = Sample(videos=[video(6, 224), video(10, 224)],
                    chunks=[Chunk(video=0), Chunk(video=1), Chunk(text="what happens", loss=True)])
    stats = Counter()
    whole = encoder(stats, 100_000, "data.video_min_pixels=3136", "data.video_max_pixels=50176")(sample)
    assert [g.tolist() for g in whole.grids] == [[6, 16, 16], [10, 16, 16]] and not stats  # 64 tokens a step

    # frames of 224 px at most 50176 pixels: 8 steps of 64 tokens; 200 tokens leave ~24 a step: 4 x 4 blocks
    shrunk = encoder(stats, 200, "data.video_min_pixels=3136", "data.video_max_pixels=50176")(sample)
    assert len(shrunk) <= 200 and stats == Counter(shrunk_videos=2)
    assert [g.tolist() for g in shrunk.grids] == [[6, 8, 8], [10, 8, 8]]
    assert kept_levels(shrunk, 0) == list(range(6)) and kept_levels(shrunk, 1) == list(range(10))

    # frames no smaller than 4 x 4 blocks (16 tokens a step: 8 steps, 128 tokens, and 4 of text): the longer
    # video gives up frames first (10 -> 8 -> 6), then the first of two as long (6 -> 4), then the other (6 -> 4)
    stats.clear()
    thinned = encoder(stats, 80, "data.video_min_pixels=12544", "data.video_max_pixels=50176")(sample)
    assert len(thinned) == 4 + 4 * 16 and stats == Counter(shrunk_videos=2, dropped_frames=8)
    assert kept_levels(thinned, 0) == [0, 2, 3, 5] and kept_levels(thinned, 1) == [0, 3, 6, 9]

    # no budget or frame count fits: skipped as any over-long sample (data.overlong: skip)
    with pytest.raises(BadSample, match="exceeds max_seq_len"):
        encoder(Counter(), 30, "data.video_min_pixels=12544", "data.video_max_pixels=50176")(sample)


def test_without_a_pixel_budget_the_longest_side_shrinks():
    sample = Sample(videos=[video(4, 224)], chunks=[Chunk(video=0), Chunk(text="what happens", loss=True)])
    stats = Counter()
    cfg = load_config(None)
    shrunk = Encoder(build_tokenizer(cfg), cfg.model, 60, "skip", 224, stats)(sample)
    assert len(shrunk) <= 60 and stats == Counter(shrunk_videos=1)
    side = int(shrunk.grids[0][1]) * 14
    assert side % BLOCK == 0 and side < 224 and kept_levels(shrunk, 0) == [0, 1, 2, 3]
