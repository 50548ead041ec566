"""Held-out synthetic samples on disk, to look at, caption or evaluate on:
``python -m ernie_moe.data.held_out --out DIR [--count N] [--config FILE]`` writes ``DIR/00000.png ...`` and
``DIR/captions.jsonl`` (the JSONL caption shape), drawn as a run with that config draws its held-out split."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from PIL import Image

from ..cli import bounded
from ..config import ConfigError, load_config
from ..paths import write_output
from .formats.synthetic import SyntheticShapes, caption

MAX_COUNT = 1_000_000  # the held-out split's images are drawn one by one: far more is a typo


def write_held_out(directory, seed: int, image_size: int, count: int) -> Path:
    """The first ``count`` held-out samples as PNG files and ``captions.jsonl`` (the JSONL caption shape);
    returns the JSONL file."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    held_out = SyntheticShapes(seed, "eval", count, image_size)
    lines = []
    for index in range(count):
        sample = held_out[index]
        name = f"{index:05d}.png"
        Image.fromarray(sample.images[0]).save(out / name)
        lines.append(json.dumps({"image": name, "text": caption(sample)}))
    write_output(out / "captions.jsonl", "\n".join(lines) + "\n")
    return out / "captions.jsonl"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True)
    parser.add_argument("--count", type=bounded(int, 1, MAX_COUNT), default=20)
    parser.add_argument("--config", help="the training config (its data.image_size and training.seed)")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config, check_paths=False)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if Path(args.out).exists() and not Path(args.out).is_dir():
        print(f"error: --out '{args.out}' exists and is not a folder; name a folder to write the images into",
              file=sys.stderr)
        return 2
    try:
        path = write_held_out(args.out, cfg.training.seed, cfg.data.image_size, args.count)
    except OSError as err:  # --out is a file, or cannot be written
        print(f"error: cannot write the held-out samples into --out '{args.out}': {err.strerror or err}",
              file=sys.stderr)
        return 2
    print(f"wrote {args.count} held-out images and their captions to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
