"""Coloured shapes at positions, captioned with their colour, shape and position.

The caption words for colour, shape and position can only be predicted by looking at the image, which
makes caption accuracy on those words a direct test of the vision path. Every sample is a pure
function of (seed, split, index).
"""

from __future__ import annotations

import numpy as np

from .sample import Chunk, Sample, unread

COLORS = {
    "red": (220, 40, 40), "green": (40, 180, 60), "blue": (50, 80, 230),
    "yellow": (230, 210, 40), "purple": (150, 60, 190), "white": (240, 240, 240),
}
SHAPES = ("square", "dot", "ring", "bar")
ROWS = ("top", "middle", "bottom")
COLUMNS = ("left", "center", "right")
TEMPLATES = ("a {color} {shape} at the {row} {column}",)
SPLITS = {"train": 0, "eval": 1}


def vocabulary() -> list[str]:
    words = set(COLORS) | set(SHAPES) | set(ROWS) | set(COLUMNS)
    for template in TEMPLATES:
        words |= {w for w in template.split() if not w.startswith("{")}
    return sorted(words)


def shape_mask(shape: str, size: int) -> np.ndarray:
    """Boolean ``[size, size]`` silhouette. The shapes differ in area and outline, so a small ViT tells them apart."""
    yy, xx = np.mgrid[0:size, 0:size] + 0.5
    c = size / 2
    radius = np.sqrt((yy - c) ** 2 + (xx - c) ** 2)
    if shape == "square":
        return np.ones((size, size), bool)
    if shape == "dot":
        return radius <= 0.3 * c
    if shape == "ring":
        return (radius <= c) & (radius >= 0.65 * c)
    return np.abs(yy - c) <= size / 8  # bar: a horizontal stripe


def paint(image: np.ndarray, d: dict) -> None:
    """Draw shape ``d`` (its shape, colour, cell, jitter and scale, as ``SyntheticShapes.describe`` draws them) into
    its cell of the square ``image``."""
    n = image.shape[0]
    cell = n / 3
    side = max(int(cell * d["scale"]), 4)
    cy = (d["row"] + 0.5 + d["jitter"][0]) * cell
    cx = (d["column"] + 0.5 + d["jitter"][1]) * cell
    top = int(np.clip(cy - side / 2, 0, n - side))
    left = int(np.clip(cx - side / 2, 0, n - side))
    mask = shape_mask(d["shape"], side)
    image[top: top + side, left: left + side][mask] = COLORS[d["color"]]


class SyntheticShapes:
    def __init__(self, seed: int, split: str, size: int, image_size: int, blank_images: bool = False):
        self.seed, self.split, self.size = seed, SPLITS[split], size
        self.image_size = image_size
        self.blank_images = blank_images

    def __len__(self) -> int:
        return self.size

    def describe(self, index: int) -> dict:
        rng = np.random.default_rng([self.seed, self.split, index])
        return {
            "color": list(COLORS)[rng.integers(len(COLORS))],
            "shape": SHAPES[rng.integers(len(SHAPES))],
            "row": int(rng.integers(3)),
            "column": int(rng.integers(3)),
            "template": int(rng.integers(len(TEMPLATES))),
            "background": int(rng.integers(90, 150)),
            "jitter": rng.uniform(-0.08, 0.08, size=2),
            "scale": rng.uniform(0.75, 0.95),
        }

    def draw(self, d: dict) -> np.ndarray:
        n = self.image_size
        image = np.full((n, n, 3), d["background"], np.uint8)
        if self.blank_images:
            return np.zeros_like(image)
        paint(image, d)
        return image

    def identity(self) -> dict:
        return {"synthetic": [self.seed, self.split, self.size, self.image_size, self.blank_images],
                "captions": [TEMPLATES, list(COLORS), SHAPES, ROWS, COLUMNS]}  # what a sample's length depends on

    def shapes(self, index: int) -> Sample:
        """Sample ``index`` without its image drawn (``sample.unread``): what its encoded length needs."""
        return self.sample(self.describe(index), draw=False)

    def __getitem__(self, index: int) -> Sample:
        if not 0 <= index < self.size:  # also ends a for loop over the set, which would otherwise never stop
            raise IndexError(f"sample {index} of {self.size}")
        return self.sample(self.describe(index))

    def sample(self, d: dict, draw: bool = True) -> Sample:
        words = {"color": d["color"], "shape": d["shape"], "row": ROWS[d["row"]], "column": COLUMNS[d["column"]]}
        chunks = [Chunk(image=0)]
        for i, word in enumerate(TEMPLATES[d["template"]].split()):
            category = word[1:-1] if word.startswith("{") else ""
            text = words[category] if category else word
            chunks.append(Chunk(text=text if i == 0 else " " + text, loss=True, scored=category))
        n = self.image_size
        return Sample(images=[self.draw(d) if draw else unread((n, n, 3))], chunks=chunks)


def caption(sample: Sample) -> str:
    return "".join(chunk.text for chunk in sample.chunks).strip()

