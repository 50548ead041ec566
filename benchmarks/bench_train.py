"""Training throughput of a config: tokens/s, step time, model FLOPs, utilisation and peak memory.

    python benchmarks/bench_train.py --config configs/vl_moe.yaml [--steps 30] [section.key=value ...]

Model FLOPs are counted as in ``ernie_moe.monitor.flops`` (6 x activated parameters x tokens, plus attention
scores). Utilisation divides the achieved FLOP/s by the device's peak: a datasheet figure on known GPUs,
a large float32 matmul measured on this machine otherwise.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import paddle

from ernie_moe.config import load_config
from ernie_moe.monitor.flops import FlopsCounter, hardware_peak
from ernie_moe.training import Trainer


def peak_memory_bytes() -> int:
    if paddle.is_compiled_with_cuda():
        return int(paddle.device.cuda.max_memory_allocated())
    return int(paddle.base.core.host_memory_stat_peak_value("Allocated", 0))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/vl_moe.yaml")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as out:
        cfg = load_config(args.config, [f"training.output_dir={out}", "logging.visualdl=false",
                                        f"training.max_steps={args.steps + args.warmup}", *args.overrides])
        trainer = Trainer(cfg)
        counter = FlopsCounter(trainer.model, cfg.model)
        for _ in range(args.warmup):
            trainer.train_step()
        tokens = flops = 0.0
        start = time.perf_counter()
        for _ in range(args.steps):
            micro_batches = trainer.next_micro_batches()
            flops += sum(counter.batch_flops(batch) for batch in micro_batches)
            tokens += trainer.train_step(micro_batches).tokens
        elapsed = time.perf_counter() - start
    peak, source = hardware_peak()
    achieved = flops / elapsed
    print(f"config {args.config} {' '.join(args.overrides)}")
    print(f"tokens/s           {tokens / elapsed:12.1f}")
    print(f"step time          {elapsed / args.steps * 1e3:12.1f} ms")
    print(f"model FLOPs/token  {flops / tokens:12.3e}")
    print(f"achieved FLOP/s    {achieved:12.3e}")
    print(f"peak FLOP/s        {peak:12.3e}  ({source})")
    print(f"utilisation        {achieved / peak:12.1%}")
    print(f"peak memory        {peak_memory_bytes() / 2**20:12.1f} MiB  (Paddle allocator)")


if __name__ == "__main__":
    main()
