"""How long the training loop waits for data, with samples decoded in the loop or by background workers.

    python benchmarks/bench_data_workers.py [--images 64] [--steps 20] [--workers 0 2]

Writes a JSONL caption set of JPEG photos-to-be (random smooth colour fields, 448 to 896 px a side, resized to
``data.max_image_side`` 448 as real data is), then trains the default model on it for ``--steps`` steps with
each ``data.num_workers`` in one process, and prints the mean step time, the mean ``data_wait_s`` and its share
of the step (the first two steps, which start the workers, are left out).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import warnings
from pathlib import Path

import numpy as np
from PIL import Image

from ernie_moe.config import load_config
from ernie_moe.training import Trainer

ROOT = Path(__file__).resolve().parents[1]


def write_images(folder: Path, count: int) -> Path:
    rng = np.random.default_rng(0)
    lines = []
    for i in range(count):
        width, height = (int(x) for x in rng.integers(448, 897, 2))
        coarse = rng.integers(0, 256, (height // 32 + 1, width // 32 + 1, 3), dtype=np.uint8)
        image = Image.fromarray(coarse).resize((width, height), Image.BICUBIC)  # smooth, so JPEG works as on photos
        image.save(folder / f"{i}.jpg", quality=90)
        lines.append(json.dumps({"image": f"{i}.jpg", "text": f"a picture numbered {i}"}))
    path = folder / "train.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=64)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    with tempfile.TemporaryDirectory() as tmp:
        data = write_images(Path(tmp), args.images)
        print("| data.num_workers | step time (ms) | data wait (ms) | data wait share |\n|---|---|---|---|")
        for workers in args.workers:
            cfg = load_config(ROOT / "configs" / "vl_moe.yaml", [
                "data.dataset=jsonl", f"data.train_path={data}", "model.vocab_size=300", "data.max_seq_len=512",
                "training.per_device_train_batch_size=2", f"data.num_workers={workers}",
                f"training.max_steps={args.steps}", "training.eval_steps=0", "logging.visualdl=false",
                "logging.progress_bar=false", "logging.logging_steps=1", f"training.output_dir={tmp}/run{workers}"])
            Trainer(cfg).train()
            metrics = (Path(tmp) / f"run{workers}" / "metrics.jsonl").read_text().splitlines()
            rows = [json.loads(line) for line in metrics if line]
            train = [r for r in rows if "loss" in r][2:]
            step = np.mean([r["step_time_s"] for r in train])
            wait = np.mean([r["data_wait_s"] for r in train])
            print(f"| {workers} | {step * 1e3:.0f} | {wait * 1e3:.0f} | {wait / step:.0%} |")


if __name__ == "__main__":
    main()
