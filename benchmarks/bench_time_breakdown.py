"""Where the default config's step time goes, and what measuring it costs.

    python benchmarks/bench_time_breakdown.py [--steps 40] [--rounds 3] [section.key=value ...]

One training process. Rounds of ``--steps`` steps alternate the breakdown on and off in the same trainer, so
that drift in machine load hits both; the ratio compares the fastest round of each. On a shared machine that
ratio drifts more than the breakdown costs, so the cost is also measured directly: the timed parts a step opens,
times what opening and closing one costs (on a GPU that includes its two device synchronisations). Then the
mean seconds of each part over the breakdown's rounds, and the share of the step the named parts cover.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections import defaultdict

from ernie_moe.config import load_config
from ernie_moe.timing import StepTimes, part
from ernie_moe.training import Trainer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as out:
        trainer = Trainer(load_config("configs/vl_moe.yaml", [
            f"training.output_dir={out}", "data.num_eval_samples=0", "logging.progress_bar=false",
            "logging.visualdl=false", *args.overrides]))
        for _ in range(5):  # warm-up
            trainer.train_step()
        rounds, parts, steps_timed = {True: [], False: []}, defaultdict(float), 0
        times = trainer.parts.step_times
        opened = count_parts(times)
        for _ in range(args.rounds):
            for on in (True, False):
                times.enabled = on
                start = time.perf_counter()
                for _ in range(args.steps):
                    result = trainer.train_step()
                    if on:
                        steps_timed += 1
                        for name, seconds in result.times.items():
                            parts[name] += seconds
                rounds[on].append((time.perf_counter() - start) / args.steps)
        del times.part
    on, off = min(rounds[True]), min(rounds[False])
    print(f"{args.steps} steps per round, fastest of {args.rounds} rounds each")
    print(f"breakdown on    {on * 1e3:8.1f} ms per step")
    print(f"breakdown off   {off * 1e3:8.1f} ms per step")
    print(f"on / off        {on / off:8.3f}")
    step = sum(rounds[True]) / len(rounds[True])
    per_step, cost = opened[0] / steps_timed, part_cost()
    print(f"the breakdown's own work: {per_step:.0f} parts per step x {cost * 1e6:.2f} us = "
          f"{per_step * cost * 1e3:.3f} ms, {per_step * cost / step:.3%} of a step")
    print("\npart                  ms per step   share")
    for name, seconds in sorted(parts.items(), key=lambda item: -item[1]):
        print(f"{name:<20} {seconds / steps_timed * 1e3:12.2f}   {seconds / steps_timed / step:6.1%}")
    covered = sum(parts.values()) / steps_timed / step
    print(f"the named parts cover {covered:.1%} of the step")


def count_parts(times: StepTimes) -> list[int]:
    """Counts, from now on, the parts ``times`` opens while it is on ([count])."""
    opened, timed = [0], times.part

    def counting(name):
        opened[0] += times.enabled
        return timed(name)
    times.part = counting  # the instance's attribute, which ernie_moe.timing.part calls
    return opened


def part_cost(calls: int = 200_000) -> float:
    """Seconds that opening and closing one part adds when the breakdown is on (fastest of 5 runs, on and off
    alternating)."""
    best, times = {True: float("inf"), False: float("inf")}, StepTimes()
    for _ in range(5):
        for on in (True, False):
            times.enabled = on
            start = time.perf_counter()
            with times.recording():
                for _ in range(calls):
                    with part("cost"):
                        pass
            best[on] = min(best[on], (time.perf_counter() - start) / calls)
    return best[True] - best[False]


if __name__ == "__main__":
    main()
