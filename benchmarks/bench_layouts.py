"""Each valid layout of N processes for a few steps: speed, communication and memory side by side.

    python benchmarks/bench_layouts.py --config configs/vl_moe.yaml --nproc 2 [--steps 12] [section.key=value ...]
        [--versus section.key=value ...] [--repeat 3]

The layouts are those the memory planner's search considers (tensor x pipeline x data, experts over the data
ranks or not, optimizer sharding over the data ranks), each keeping the config's global batch. Every layout is
launched with ``paddle.distributed.launch``; the figures are its last logging window (steady state): tokens/s,
step time, the share of rank 0's step spent in communication (``time/communication_share``) and waiting in
the pipeline's bubble (``time/pipeline_bubble_s``), and the allocator peak of the busiest and the least busy
rank. ``--versus`` runs each layout a second time with those overrides, the two rows side by side (a before
and after in one run: ``--versus parallel.overlap_grad_sync=false``); ``--repeat N`` launches each row N times,
the runs of a layout's rows alternating, and reports the run of median tokens/s (a shared machine's speed
drifts by more than the differences worth measuring).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from ernie_moe.config import load_config
from ernie_moe.memory.search import describe, overrides_of, with_layout
from ernie_moe.parallel.layout import Layout

ROOT = Path(__file__).resolve().parents[1]


def layouts(cfg, world: int) -> list:
    micro = cfg.training.per_device_train_batch_size
    found = []
    powers = [d for d in (1, 2, 4, 8) if world % d == 0]
    for tp, pp in itertools.product(powers, powers):
        if world % (tp * pp):
            continue
        data = Layout(world, tp, pp).data_world
        for ep, sharded in itertools.product(sorted({1, data}), (False, True)):
            if sharded and data == 1:
                continue
            candidate = with_layout(cfg, tp, pp, 1, data if sharded else 1, ep, None, micro, world)
            if candidate is not None and describe(candidate) not in {describe(c) for c in found}:
                found.append(candidate)
    return found


def measure(candidate, config: str, world: int, steps: int, overrides: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "run"
        command = [sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", str(world),
                   "--log_dir", str(Path(scratch) / "log"), str(ROOT / "run_trainer.py"), "--config", config,
                   f"training.output_dir={out}", f"training.max_steps={steps}", f"logging.logging_steps={steps // 2}",
                   "training.eval_steps=0", "data.num_eval_samples=0", "logging.progress_bar=false",
                   "logging.visualdl=false", *overrides, *overrides_of(candidate)]
        done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT,
                              env=dict(os.environ, OMP_NUM_THREADS="1"))
        if done.returncode != 0:
            return {}
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        return [r for r in records if "loss" in r][-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(ROOT / "configs" / "vl_moe.yaml"))
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--versus", nargs="+", default=[], help="overrides of a second run of every layout")
    parser.add_argument("--repeat", type=int, default=1, help="launches per row; the median run is reported")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    cfg = load_config(args.config, args.overrides)
    print(f"{args.nproc} processes, {args.config}, last {args.steps // 2} of {args.steps} steps\n")
    print("| layout | tokens/s | step (ms) | communication | bubble | peak MiB, busiest rank | least busy |")
    print("|---|---|---|---|---|---|---|")
    runs = [("", args.overrides)] + ([(" (" + " ".join(args.versus) + ")", args.overrides + args.versus)]
                                     if args.versus else [])
    for candidate in layouts(cfg, args.nproc):
        measured: list[list[dict]] = [[] for _ in runs]
        for _ in range(args.repeat):
            for rows, (_, overrides) in zip(measured, runs):
                rows.append(measure(candidate, args.config, args.nproc, args.steps, overrides))
        for rows, (suffix, _) in zip(measured, runs):
            label = f"dp{Layout.of(candidate.parallel, args.nproc).dp}, {describe(candidate)}{suffix}"
            print(row_of(label, median_run(rows)), flush=True)


def median_run(rows: list[dict]) -> dict:
    """The run of median tokens/s (none when a launch failed)."""
    if not all(rows):
        return {}
    speed = statistics.median_low([r["tokens_per_sec"] for r in rows])
    return next(r for r in rows if r["tokens_per_sec"] == speed)


def row_of(label: str, row: dict) -> str:
    if not row:
        return f"| {label} | failed | | | | | |"
    return (f"| {label} | {row['tokens_per_sec']:.0f} | {row['step_time_s'] * 1e3:.1f} | "
            f"{row.get('time/communication_share', 0):.1%} | "
            f"{row.get('time/pipeline_bubble_s', 0) / row['step_time_s']:.1%} | "
            f"{row['memory/max_rank_max_allocated_gb'] * 1024:.1f} | "
            f"{row['memory/min_rank_max_allocated_gb'] * 1024:.1f} |")


if __name__ == "__main__":
    main()
