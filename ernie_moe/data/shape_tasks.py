"""Two tasks on the synthetic shapes as conversations, for fine-tuning experiments: each as training records
(the JSONL ``messages`` shape) and as a benchmark file in OCRBench's shape (``question, answer, image,
question_type``: the gold answer must appear in the reply), with the word tokenizer both are written in.

- ``captions``: one shape; asked ``describe``, the answer is its caption (``a red dot at the top left``), as the
  default run's captions;
- ``where``: three shapes of different kinds and colours in different cells; asked ``where is the ring``, the
  answer is the asked shape's caption. It needs no caption of a lone shape, and teaches none.

``python -m ernie_moe.data.shape_tasks --out DIR [--count N] [--benchmark-count N]`` writes ``DIR/tokenizer/``,
and per task ``DIR/<task>/train.jsonl`` and the benchmark ``DIR/<task>/<task>.jsonl``, with their images.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
from PIL import Image

from ..cli import bounded
from ..paths import write_output
from .encoding.tokenizer import WordTokenizer
from .formats.synthetic import COLORS, COLUMNS, ROWS, SHAPES, paint, vocabulary

TASKS = ("captions", "where")
WORDS = vocabulary() + ["User:", "Assistant:", "describe", "where", "is"]  # the chat's plain prefixes are words
SPLITS = {"train": 0, "benchmark": 1}
MAX_COUNT = 1_000_000
SHAPES_SHOWN = 3  # in a 'where' image


def _placed(rng: np.random.Generator, shape: str, color: str, cell: int) -> dict:
    return {"shape": shape, "color": color, "row": cell // 3, "column": cell % 3,
            "jitter": rng.uniform(-0.08, 0.08, size=2), "scale": rng.uniform(0.75, 0.95)}


def _caption(d: dict) -> str:
    return f"a {d['color']} {d['shape']} at the {ROWS[d['row']]} {COLUMNS[d['column']]}"


def example(task: str, seed: int, split: str, index: int, image_size: int) -> tuple[np.ndarray, str, str, str]:
    """(image, question, answer, category) of one example; a pure function of its arguments."""
    rng = np.random.default_rng([seed, 7 + TASKS.index(task), SPLITS[split], index])
    image = np.full((image_size, image_size, 3), int(rng.integers(90, 150)), np.uint8)
    count = 1 if task == "captions" else SHAPES_SHOWN
    shapes = rng.choice(len(SHAPES), count, replace=False)
    colors = rng.choice(len(COLORS), count, replace=False)
    cells = rng.choice(9, count, replace=False)
    placed = [_placed(rng, SHAPES[s], list(COLORS)[c], int(cell)) for s, c, cell in zip(shapes, colors, cells)]
    for d in placed:
        paint(image, d)
    asked = placed[int(rng.integers(count))]
    question = "describe" if task == "captions" else f"where is the {asked['shape']}"
    return image, question, _caption(asked), asked["shape"]


def write_task(directory, task: str, seed: int, image_size: int, count: int, benchmark_count: int) -> Path:
    """``directory/<task>/train.jsonl`` (``count`` records) and the benchmark ``<task>.jsonl``
    (``benchmark_count`` questions), their images beside them; returns the task's folder."""
    folder = Path(directory) / task
    (folder / "images").mkdir(parents=True, exist_ok=True)
    for split, total, name in (("train", count, "train.jsonl"), ("benchmark", benchmark_count, f"{task}.jsonl")):
        lines = []
        for index in range(total):
            image, question, answer, category = example(task, seed, split, index, image_size)
            file = f"images/{split}-{index:06d}.png"
            Image.fromarray(image).save(folder / file)
            if split == "train":
                record = {"images": [file], "messages": [{"role": "user", "content": f"<image>{question}"},
                                                         {"role": "assistant", "content": answer}]}
            else:
                record = {"id": f"{task}-{index}", "question": question, "answer": [answer], "image": file,
                          "question_type": category}
            lines.append(json.dumps(record))
        write_output(folder / name, "\n".join(lines) + "\n")
    return folder


def write_tokenizer(directory) -> Path:
    folder = Path(directory) / "tokenizer"
    folder.mkdir(parents=True, exist_ok=True)
    WordTokenizer(WORDS).save(folder)
    return folder


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--count", type=bounded(int, 1, MAX_COUNT), default=4000, help="training records per task")
    parser.add_argument("--benchmark-count", type=bounded(int, 1, MAX_COUNT), default=256,
                        help="benchmark questions per task")
    parser.add_argument("--image-size", type=bounded(int, 28, 1024), default=84)
    parser.add_argument("--seed", type=bounded(int, 0), default=0)
    args = parser.parse_args(argv)
    try:
        write_tokenizer(args.out)
        for task in TASKS:
            write_task(args.out, task, args.seed, args.image_size, args.count, args.benchmark_count)
    except OSError as err:
        print(f"error: cannot write into --out '{args.out}': {err.strerror or err}", file=sys.stderr)
        return 2
    print(f"wrote {', '.join(TASKS)} ({args.count} training records, {args.benchmark_count} benchmark questions "
          f"each) and the tokenizer to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
