"""Time and allocator peak of a training step under each recompute granularity.

    python benchmarks/bench_recompute.py [--steps 5]

One process, 8 decoder layers, 8 rows of 256 tokens: the step time is the median of ``--steps`` steps after
one warm-up step; the peak is Paddle's allocator peak over those steps. Ratios are against no recompute.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import warnings
from pathlib import Path

from ernie_moe.config import load_config
from ernie_moe.training import Trainer

SHAPE = ["data.max_seq_len=256", "training.per_device_train_batch_size=8", "model.num_hidden_layers=8",
         "logging.visualdl=false", "logging.monitor=false", "training.memory_guard_fraction=0"]


def measure(steps: int, *overrides) -> tuple[float, float]:
    with tempfile.TemporaryDirectory() as out:
        cfg = load_config(Path(__file__).resolve().parents[1] / "configs" / "vl_moe.yaml",
                          [*SHAPE, f"training.output_dir={out}", *overrides])
        trainer = Trainer(cfg)
        trainer.train_step()
        memory = trainer.monitor.memory  # each step's allocator peak; the window keeps the largest
        memory.pop_window()
        times = []
        for _ in range(steps):
            started = time.perf_counter()
            trainer.train_step()
            times.append(time.perf_counter() - started)
        return statistics.median(times), memory.window_peak / 2 ** 20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    base_time, base_peak = measure(args.steps)
    print(f"{'recompute':>10} {'step ms':>9} {'x time':>7} {'peak MiB':>9} {'x peak':>7}")
    print(f"{'none':>10} {base_time * 1e3:9.1f} {1:7.2f} {base_peak:9.1f} {1:7.2f}")
    for granularity in ("moe", "core_attn", "full_attn", "full"):
        step, peak = measure(args.steps, "training.recompute=true", f"training.recompute_granularity={granularity}")
        print(f"{granularity:>10} {step * 1e3:9.1f} {step / base_time:7.2f} {peak:9.1f} {peak / base_peak:7.2f}")


if __name__ == "__main__":
    main()
