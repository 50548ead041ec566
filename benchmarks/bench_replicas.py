"""What the replica check and the EMA cost against a training step, measured in one run.

    python -m paddle.distributed.launch --nproc_per_node 2 benchmarks/bench_replicas.py \
        --config configs/vl_moe.yaml [--steps 20] [section.key=value ...]

Times, on every rank and reported by rank 0 as the slowest rank's mean: a training step, one replica check
(``parallel.replicas.compare_replicas``: the digests and their all-gather) and one EMA update.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import paddle

from ernie_moe.config import load_config
from ernie_moe.parallel.replicas import compare_replicas
from ernie_moe.training import Trainer


def mean_seconds(run, times: int, env) -> float:
    started = time.perf_counter()
    for _ in range(times):
        run()
    seconds = paddle.to_tensor([(time.perf_counter() - started) / times], dtype="float64")
    if env.world_size > 1:
        paddle.distributed.all_reduce(seconds, op=paddle.distributed.ReduceOp.MAX)
    return float(seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/vl_moe.yaml")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as out:
        cfg = load_config(args.config, [f"training.output_dir={out}", "logging.visualdl=false",
                                        "training.ema_decay=0.999", f"training.max_steps={2 * args.steps + 5}",
                                        *args.overrides])
        trainer = Trainer(cfg)
        env = trainer.env
        for trainer.step in range(1, 6):  # warm-up: the allocator and the EMA's first copy
            trainer.train_step()

        def step():
            trainer.step += 1
            trainer.train_step()

        step_s = mean_seconds(step, args.steps, env)
        check_s = mean_seconds(lambda: compare_replicas(trainer.replicas.sets, env), args.steps, env)
        ema_s = mean_seconds(lambda: trainer.parts.ema.update(trainer.step), args.steps, env)
        held = sum(p.size * p.element_size() for s in trainer.replicas.sets for _, p in s.named)
        if env.is_main:
            print(f"{env.world_size} ranks, {held / 2 ** 20:.1f} MiB of replicated weights per rank: step "
                  f"{step_s * 1e3:.1f} ms, replica check {check_s * 1e3:.1f} ms ({check_s / step_s:.1%} of a step), "
                  f"EMA update {ema_s * 1e3:.2f} ms ({ema_s / step_s:.1%})")


if __name__ == "__main__":
    main()
