"""Training throughput of a config: tokens/s, step time, model FLOPs, utilisation and peak memory.

    python benchmarks/bench_train.py --config configs/vl_moe.yaml [--steps 30] [section.key=value ...]
    python benchmarks/bench_train.py --profile          # ... and ops per step, host reads per step, top ops by time
    python benchmarks/bench_train.py --against REF      # this tree against git revision REF, rounds alternated

Model FLOPs are counted as in ``ernie_moe.monitor.flops`` (6 x activated parameters x tokens, plus attention
scores). Utilisation divides the achieved FLOP/s by the device's peak: a datasheet figure on known GPUs,
a large float32 matmul measured on this machine otherwise.

``--profile`` runs Paddle's profiler over the timed steps: the operators each step launches (forward ops and
backward nodes), the device-to-host reads each step makes (``ernie_moe.host_reads``: by reason, and any other by
its line), and the operators that take the most time. ``--against REF`` checks REF out beside this tree (a git
worktree) and runs the same measurement in each, one process per round, alternating, so that load on a shared
machine falls on both; it reports each round, and the ratio of the medians.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def measure(args) -> dict:
    import paddle

    from ernie_moe.config import load_config
    from ernie_moe.monitor.flops import FlopsCounter
    from ernie_moe.training import Trainer

    with tempfile.TemporaryDirectory() as out:
        cfg = load_config(args.config, [f"training.output_dir={out}", "logging.visualdl=false",
                                        f"training.max_steps={args.steps + args.warmup}", *args.overrides])
        trainer = Trainer(cfg)
        counter = FlopsCounter(trainer.parts.model, cfg.model)
        for _ in range(args.warmup):
            trainer.train_step()
        profile = Profile(args.steps) if args.profile else None
        flops, results = 0.0, []
        start = time.perf_counter()
        with profile.recording() if profile else contextlib.nullcontext():
            for _ in range(args.steps):
                micro_batches = trainer.next_micro_batches()
                flops += sum(counter.batch_flops(batch) for batch in micro_batches)
                results.append(trainer.train_step(micro_batches))
        tokens = sum(float(result.tokens) for result in results)  # read once the steps are done
        elapsed = time.perf_counter() - start
        trainer.parts.feed.close()
    result = {"tokens_per_s": tokens / elapsed, "step_ms": elapsed / args.steps * 1e3, "flops": flops,
              "tokens": tokens, "elapsed": elapsed, "peak_memory_mib": peak_memory_bytes(paddle) / 2 ** 20}
    if profile:
        result.update(profile.figures())
    return result


class Profile:
    """Paddle's profiler and the host-read counter over the timed steps."""

    def __init__(self, steps: int):
        self.steps = steps
        self.folder = tempfile.mkdtemp()

    def recording(self):
        import paddle.profiler as profiler

        try:
            from ernie_moe.host_reads import HostReadCounter
            self.reads = HostReadCounter()
        except ImportError:  # a revision from before the counter (--against)
            self.reads = None

        @contextlib.contextmanager
        def both():
            self.profiler = profiler.Profiler(targets=[profiler.ProfilerTarget.CPU, profiler.ProfilerTarget.GPU],
                                              on_trace_ready=lambda _: None)  # exported below, not into ./
            self.profiler.start()
            try:
                with self.reads.counting() if self.reads else contextlib.nullcontext():
                    yield
            finally:
                self.profiler.stop()
                self.profiler.export(str(Path(self.folder) / "trace.json"), format="json")

        return both()

    def figures(self) -> dict:
        trace = json.loads((Path(self.folder) / "trace.json").read_text())
        events = trace["traceEvents"] if isinstance(trace, dict) else trace
        ops = [e for e in events if e.get("cat") == "Operator"]
        times: Counter = Counter()
        calls: Counter = Counter()
        for e in ops:
            name = re.sub(r"\[[^\]]*\]$", "", e["name"])
            times[name] += float(e.get("dur", 0.0))
            calls[name] += 1
        reads = self.reads.total() if self.reads else {"declared": {}, "undeclared": {"(not counted)": 0}}
        return {"ops_per_step": len(ops) / self.steps,
                "host_reads_per_step": {**{k: v / self.steps for k, v in reads["declared"].items()},
                                        **{f"undeclared {k}": v / self.steps for k, v in reads["undeclared"].items()}},
                "top_ops": [(name, ms / 1e3 / self.steps, calls[name] / self.steps)
                            for name, ms in times.most_common(15)]}


def peak_memory_bytes(paddle) -> int:
    if paddle.is_compiled_with_cuda():
        return int(paddle.device.cuda.max_memory_allocated())
    return int(paddle.base.core.host_memory_stat_peak_value("Allocated", 0))


def report(args, result: dict) -> None:
    from ernie_moe.monitor.flops import hardware_peak

    peak, source = hardware_peak()
    achieved = result["flops"] / result["elapsed"]
    print(f"config {args.config} {' '.join(args.overrides)}")
    print(f"tokens/s           {result['tokens_per_s']:12.1f}")
    print(f"step time          {result['step_ms']:12.1f} ms")
    print(f"model FLOPs/token  {result['flops'] / result['tokens']:12.3e}")
    print(f"achieved FLOP/s    {achieved:12.3e}")
    print(f"peak FLOP/s        {peak:12.3e}  ({source})")
    print(f"utilisation        {achieved / peak:12.1%}")
    print(f"peak memory        {result['peak_memory_mib']:12.1f} MiB  (Paddle allocator)")
    if "ops_per_step" in result:
        print(f"ops per step       {result['ops_per_step']:12.1f}  (forward ops and backward nodes)")
        reads = result["host_reads_per_step"]
        print(f"host reads/step    {sum(reads.values()):12.2f}  " +
              (", ".join(f"{k} {v:g}" for k, v in sorted(reads.items())) or "none"))
        print("top ops by time (ms per step, calls per step):")
        for name, ms, calls in result["top_ops"]:
            print(f"  {ms:8.2f} {calls:6.1f}  {name}")


def against(args) -> None:
    """This tree and REF's, alternated round by round, each round one process per tree."""
    with tempfile.TemporaryDirectory() as scratch:
        other = Path(scratch) / "ref"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(other), args.against],
                       check=True)
        try:
            trees = {args.against: other, "this tree": ROOT}
            runs: dict[str, list[dict]] = {name: [] for name in trees}
            for round_ in range(args.rounds):
                for name, tree in trees.items():
                    runs[name].append(_run_in(tree, args))
                    print(f"round {round_ + 1} {name:>12}: {runs[name][-1]['tokens_per_s']:9.1f} tokens/s"
                          + (f", {runs[name][-1]['ops_per_step']:.0f} ops/step" if args.profile else ""), flush=True)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(other)], check=False)
    medians = {name: statistics.median(r["tokens_per_s"] for r in rs) for name, rs in runs.items()}
    print(f"median tokens/s: {args.against} {medians[args.against]:.1f}, this tree {medians['this tree']:.1f}; "
          f"ratio {medians['this tree'] / medians[args.against]:.2f}x")
    if args.profile:
        for name, rs in runs.items():
            print(f"{name}: {rs[-1]['ops_per_step']:.0f} ops per step, "
                  f"{sum(rs[-1]['host_reads_per_step'].values()):.2f} host reads per step")


def _run_in(tree: Path, args) -> dict:
    """One measurement by this script with ``tree``'s package, in a process of its own."""
    command = [sys.executable, __file__, "--json", "--config", args.config, "--steps", str(args.steps),
               "--warmup", str(args.warmup), *(["--profile"] if args.profile else []), *args.overrides]
    env = dict(os.environ, PYTHONPATH=str(tree))
    done = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"the run in {tree} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/vl_moe.yaml")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--profile", action="store_true", help="ops, host reads and top ops per step")
    parser.add_argument("--against", metavar="REF", help="alternate rounds with git revision REF")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per tree with --against")
    parser.add_argument("--json", action="store_true", help=argparse.SUPPRESS)  # one line for --against
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    if args.against:
        against(args)
        return
    result = measure(args)
    if args.json:
        print(json.dumps(result))
    else:
        report(args, result)


if __name__ == "__main__":
    main()
