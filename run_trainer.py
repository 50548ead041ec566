"""Train the multimodal MoE model: ``python -m paddle.distributed.launch run_trainer.py --config FILE [k=v ...]``."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import warnings


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", required=True, help="YAML config (see configs/vl_moe.yaml)")
    parser.add_argument("overrides", nargs="*", help="section.key=value, e.g. training.max_steps=20")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore", message="No ccache found")  # Paddle's, irrelevant to training

    from ernie_moe.checkpoint import CheckpointError
    from ernie_moe.config import ConfigError, load_config
    from ernie_moe.data import DataError
    from ernie_moe.elastic.launch import mark_finished
    from ernie_moe.training.precision import NonFiniteGradients
    from ernie_moe.training.replica_check import ReplicasDiffer
    from ernie_moe.training.stop import EXIT_CODE, StopRequested

    # (error, how its one line starts, exit code); OSError: the disk or permissions, the environment
    expected = ((ConfigError, "config error", 2), (DataError, "data error", 2),
                (CheckpointError, "checkpoint error", 2), (NonFiniteGradients, "training stopped", 3),
                (ReplicasDiffer, "training stopped", 3),
                (StopRequested, "stopped", EXIT_CODE), (OSError, "error", 2))
    try:
        cfg = load_config(args.config, args.overrides)
        from ernie_moe.training import Trainer

        trainer = Trainer(cfg)
        summary = trainer.train()
    except tuple(kind for kind, _, _ in expected) as err:
        label, code = next((label, code) for kind, label, code in expected if isinstance(err, kind))
        if code == EXIT_CODE:  # the launcher stops the ranks still leaving once one has left: the stop stands
            signal.signal(signal.SIGTERM, lambda *_: os._exit(EXIT_CODE))
        print(f"{label}: {err}", file=sys.stderr)
        if code == 2:
            mark_finished(unfixable=True)  # python -m ernie_moe.elastic: a restart would meet it again
        return code
    except RuntimeError as err:
        from ernie_moe.parallel.env import peer_lost

        line = peer_lost(err)
        if line is None:
            raise
        print(f"distributed error: {line}", file=sys.stderr)
        return 1
    if trainer.env.is_main:
        print(format_summary(summary), flush=True)
    mark_finished()  # for python -m ernie_moe.elastic: the job ended because it was done
    return 0


def format_summary(summary: dict) -> str:
    if not summary["run_steps"]:
        parts = [f"done: nothing trained (resumed at step {summary['steps']}, which training.max_steps does not "
                 "exceed)"]
    else:
        parts = [f"done: {summary['steps']} steps in {summary['train_time_s']:.0f}s"]
    if summary["skipped_steps"]:
        parts.append(f"{summary['skipped_steps']} of {summary['run_steps']} steps skipped for non-finite gradients")
    for key in ("eval_loss", "eval_caption_accuracy", "eval_token_accuracy"):
        if key in summary:
            parts.append(f"{key} {summary[key]:.4f}")
    for key in sorted(k for k in summary if k.startswith("eval_bench/") and k.count("/") == 1):
        parts.append(f"{key} {summary[key]:.4f}")  # each benchmark's score (its categories: metrics.jsonl)
    skipped = {k: v for k, v in summary.items() if k.startswith("data/")}
    if skipped:
        parts.append("skipped samples " + ", ".join(f"{k[5:]}={v}" for k, v in skipped.items()))
    if "model_dir" in summary:
        parts.append(f"model saved to {summary['model_dir']}")
    if summary.get("rollouts"):
        parts.append(f"sampled answers in {summary['rollouts']}")
    return " | ".join(parts)


if __name__ == "__main__":
    sys.exit(main())
