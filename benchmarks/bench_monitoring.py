"""What monitoring costs: the default config trained with ``logging.monitor`` on and off.

    python benchmarks/bench_monitoring.py [--steps 100] [--rounds 2] [section.key=value ...]

Runs alternate (on, off, on, off, ...) so that drift in machine load hits both; the fastest run of each
setting is compared. Monitoring covers per-expert counters, router-loss logging, memory, FLOPs, histograms
and heat maps; counters stay on the device and are read once per logging window.
"""

from __future__ import annotations

import argparse
import tempfile

from ernie_moe.config import load_config
from ernie_moe.training import Trainer


def run(monitor: bool, steps: int, overrides: list[str]) -> float:
    with tempfile.TemporaryDirectory() as out:
        cfg = load_config("configs/vl_moe.yaml", [
            f"training.output_dir={out}", f"training.max_steps={steps}", "data.num_eval_samples=0",
            "logging.progress_bar=false", f"logging.monitor={str(monitor).lower()}", *overrides,
        ])
        return Trainer(cfg).train()["train_time_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    times = {True: [], False: []}
    for _ in range(args.rounds):
        for monitor in (True, False):
            times[monitor].append(run(monitor, args.steps, args.overrides))
    on, off = min(times[True]), min(times[False])
    print(f"{args.steps} steps, logging every 10 (fastest of {args.rounds} runs each)")
    print(f"monitor on    {on:8.2f} s   {[round(t, 2) for t in times[True]]}")
    print(f"monitor off   {off:8.2f} s   {[round(t, 2) for t in times[False]]}")
    print(f"on / off      {on / off:8.3f}")


if __name__ == "__main__":
    main()
