"""What each rank holds at sharding stages 1, 2 and 3, measured beside the memory planner's prediction.

    python benchmarks/bench_sharding.py [--nproc 4] [--steps 3] [section.key=value ...]

The same model and global batch run in one process and over ``--nproc`` sharding ranks at each stage (launched with
``paddle.distributed.launch``). Per layout, from the last step's metrics: the bytes the busiest rank, and the ranks
on average, hold between steps (Paddle's allocator after the update: weights, gradients and optimizer states, the
model's buffers and what the step left) and the busiest rank's peak during the step, each beside the planner's
(``parameters + gradients + optimizer``; the whole step). The planner assumes equal shares; parameters are owned
whole, so where one parameter is a large part of the model the busiest rank holds more than the mean. The model is
the default config's, wider and on short rows, so that weights, gradients and states, not activations, decide; the
step time is the last step's (with more processes than cores it measures the machine, not the stage).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from ernie_moe.config import load_config
from ernie_moe.memory.estimate import estimate, sample_workload

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "vl_moe.yaml"
WIDE = ["model.hidden_size=256", "model.intermediate_size=1024", "model.moe_intermediate_size=[256,128]",
        "data.max_seq_len=16", "data.image_size=56", "training.eval_steps=0", "data.num_eval_samples=0",
        "logging.visualdl=false", "logging.progress_bar=false", "logging.logging_steps=1"]
MIB = 2 ** 20


def run(nproc: int, steps: int, overrides: list[str]) -> dict:
    """The last step's metrics record of a launched run."""
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "run"
        command = [sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", str(nproc),
                   "--log_dir", str(Path(scratch) / "log"), str(ROOT / "run_trainer.py"), "--config", str(CONFIG),
                   f"training.output_dir={out}", f"training.max_steps={steps}", *overrides]
        done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
        if done.returncode:
            logs = "".join(p.read_text(errors="replace")[-2000:] for p in (Path(scratch) / "log").glob("workerlog.*"))
            raise SystemExit(f"{' '.join(command)} failed:\n{done.stdout[-2000:]}{logs}")
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        return [r for r in records if r.get("step") == steps and "loss" in r][-1]


def planned(nproc: int, overrides: list[str]) -> tuple[float, float]:
    """(held between steps, the step's peak) of the busiest rank, as the planner predicts them."""
    cfg = load_config(CONFIG, overrides, check_paths=False)
    stages = estimate(cfg, sample_workload(cfg, nproc), nproc)
    busiest = max(stages, key=lambda s: s.total)
    return busiest.parameters + busiest.gradients + busiest.optimizer, busiest.total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    rows_per_step = args.nproc  # one row per rank and step: the same global batch everywhere
    layouts = {"one process": (1, [f"training.per_device_train_batch_size={rows_per_step}"])}
    for stage in ("stage1", "stage2", "stage3"):
        layouts[f"sharding {args.nproc}, {stage}"] = (args.nproc, [
            f"parallel.sharding_parallel_degree={args.nproc}", f"parallel.sharding={stage}",
            "training.per_device_train_batch_size=1"])
    print("| layout | held between steps (MiB): busiest rank, mean over ranks / planned | step peak (MiB), measured "
          "/ planned | mean held vs one process | step (ms) |\n|---|---|---|---|---|")
    alone = None
    for name, (nproc, layout) in layouts.items():
        overrides = [*WIDE, *layout, *args.overrides]
        record = run(nproc, args.steps, overrides)
        held = [record[f"memory/rank{r}/allocated_gb"] * 1024 for r in range(nproc)]
        mean = sum(held) / nproc
        peak = record["memory/max_rank_max_allocated_gb"] * 1024
        alone = alone or mean
        predicted_held, predicted_peak = (x / MIB for x in planned(nproc, overrides))
        print(f"| {name} | {max(held):.2f}, {mean:.2f} / {predicted_held:.2f} | {peak:.2f} / {predicted_peak:.2f} | "
              f"{mean / alone:.2f} | {record['step_time_s'] * 1e3:.0f} |", flush=True)


if __name__ == "__main__":
    main()
