"""What a fine-tune costs the skills it does not train, and what mixing the old data in holds.

    python benchmarks/bench_forgetting.py [--out output/forgetting] [--base-steps 1200] [--tune-steps 1000]

Writes the two shape tasks (``python -m ernie_moe.data.shape_tasks``: ``captions``, asked ``describe``, and
``where``, three shapes with one asked for), trains a base on the captions (the default config, the task's word
tokenizer), fine-tunes it on ``where`` alone and on ``where`` with the captions mixed in half and half
(``data.train_path`` + ``data.train_probs``), and compares each fine-tune with the base on both benchmarks
(``python -m ernie_moe.compare``): ``OUT/report_where_only`` and ``OUT/report_mixed`` each hold ``report.md``,
``report.json`` and ``report.png``. Every command it runs is printed before it runs.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(*argv: str) -> float:
    """Run one of the package's commands from the repository root; its wall time."""
    print("$", shlex.join(argv), flush=True)
    began = time.perf_counter()
    subprocess.run([sys.executable, *argv], cwd=ROOT, check=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    return time.perf_counter() - began


def train(out: Path, name: str, steps: int, *overrides: str) -> Path:
    run("run_trainer.py", "--config", "configs/vl_moe.yaml", "data.dataset=jsonl", "data.eval_path=",
        f"data.tokenizer_path={out / 'tokenizer'}", f"training.output_dir={out / name}", f"training.max_steps={steps}",
        "training.eval_steps=0", "training.overwrite_output_dir=true", "logging.progress_bar=false", *overrides)
    return out / name / "final_model"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="output/forgetting")
    parser.add_argument("--base-steps", type=int, default=1200)
    parser.add_argument("--tune-steps", type=int, default=1000)
    parser.add_argument("--tune-lr", default="3e-3")
    args = parser.parse_args()
    out = Path(args.out).resolve()
    run("-m", "ernie_moe.data.shape_tasks", "--out", str(out))
    captions, where = out / "captions", out / "where"
    base = train(out, "base", args.base_steps, f"data.train_path={captions / 'train.jsonl'}")
    tune = [f"training.model_name_or_path={base}", f"training.learning_rate={args.tune_lr}",
            f"training.min_lr={float(args.tune_lr) / 10}"]
    where_only = train(out, "where_only", args.tune_steps, *tune, f"data.train_path={where / 'train.jsonl'}")
    mixed = train(out, "mixed", args.tune_steps, *tune,
                  f"data.train_path=[{where / 'train.jsonl'},{captions / 'train.jsonl'}]", "data.train_probs=[0.5,0.5]")
    benchmarks = ["--benchmark", f"ocrbench:{captions / 'captions.jsonl'}",
                  "--benchmark", f"ocrbench:{where / 'where.jsonl'}"]
    run("-m", "ernie_moe.evaluate", "--model", str(base), *benchmarks, "--out", str(out / "base.json"),
        "--no-progress")
    for name, tuned in (("where_only", where_only), ("mixed", mixed)):
        run("-m", "ernie_moe.compare", "--before", str(out / "base.json"), "--after", str(tuned), *benchmarks,
            "--out", str(out / f"report_{name}"))


if __name__ == "__main__":
    main()
