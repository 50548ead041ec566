"""What monitoring costs: the default config trained with ``logging.monitor`` on and off.

    python benchmarks/bench_monitoring.py [--steps 100] [--rounds 2] [section.key=value ...]

Runs alternate (on, off, on, off, ...) so that drift in machine load hits both; the fastest run of each
setting is compared. On a shared machine that ratio moves by a few percent from run to run, so the script
also times the monitoring calls themselves inside one training process: the per-step work (expert
counters, FLOPs, memory sample) and the per-window report (reductions, summaries, heat maps and bar charts).
"""

from __future__ import annotations

import argparse
import tempfile
import time

from ernie_moe.config import load_config
from ernie_moe.training import Trainer


def run(monitor: bool, steps: int, overrides: list[str]) -> float:
    with tempfile.TemporaryDirectory() as out:
        cfg = load_config("configs/vl_moe.yaml", [
            f"training.output_dir={out}", f"training.max_steps={steps}", "data.num_eval_samples=0",
            "logging.progress_bar=false", f"logging.monitor={str(monitor).lower()}", *overrides,
        ])
        return Trainer(cfg).train()["train_time_s"]


def call_costs(steps: int, overrides: list[str]) -> tuple[float, float, float]:
    """(monitoring ms per step, report ms per window, training ms per step) measured in one process."""
    with tempfile.TemporaryDirectory() as out:
        cfg = load_config("configs/vl_moe.yaml", [f"training.output_dir={out}", "logging.progress_bar=false",
                                                  "data.num_eval_samples=0", *overrides])
        trainer = Trainer(cfg)
        monitor = trainer.monitor
        for _ in range(5):
            trainer.train_step()
        per_step = window_cost = step_cost = 0.0
        for _ in range(steps):
            batches = trainer.next_micro_batches()
            moes = trainer.parts.model.moe_layers()
            start = time.perf_counter()
            result = trainer.train_step(batches)
            step_cost += time.perf_counter() - start
            start = time.perf_counter()
            monitor.step_flops(batches)
            monitor.after_step()
            for moe in moes:  # what each forward records: losses per modality, routing counts
                for g in range(len(moe.router_counts)):
                    moe.stats.record_losses(g, {k: moe.stats.loss_sums[0, 0] for k in ("aux_loss", "z_loss",
                                                                                     "orthogonal_loss")})
                moe.stats.record_routing(moe.stats.usage, moe.stats.usage)
            per_step += time.perf_counter() - start
            start = time.perf_counter()
            monitor.end_window(trainer.step, [result.read()], trainer.parts.data_stats)
            window_cost += time.perf_counter() - start
        monitor.close()
        return per_step / steps * 1e3, window_cost / steps * 1e3, step_cost / steps * 1e3


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
    step_ms, window_ms, train_ms = call_costs(30, args.overrides)
    every = 10
    share = (step_ms + window_ms / every) / train_ms
    print(f"monitoring calls: {step_ms:.3f} ms per step + {window_ms:.2f} ms per window, "
          f"a training step {train_ms:.1f} ms -> {share:.2%} at logging_steps {every}")


if __name__ == "__main__":
    main()
