"""The sampler-trainer mismatch of a GRPO run, with router replay on and off, and what the importance corrections
(TIS, MIS) do to the run.

    python benchmarks/bench_rl_mismatch.py [--sft-steps 300] [--grpo-steps 200] [--capacity 1.0 2.0 2.0]
        [--seeds 1 2] [--model DIR]

A captioner trained here for ``--sft-steps`` supervised steps (8 rows a step, the ViT at the base rate: the README's
GRPO start), or the folder ``--model``, then GRPO runs of ``--grpo-steps`` from it, each with the MoE capacity
``--capacity`` (train, eval, eval with fewer tokens than experts): training drops expert choices that the sampler,
one token at a time in evaluation mode, kept, so routing differs between sampling and training unless it is
replayed. Each run reports, over its steps, the mean ``rl/mismatch_k3`` (per token), the mean share of tokens whose
ratio passes 2 either way, the largest ratio, the share the correction capped or left out (each the mean over the
runs of ``--seeds``, the GRPO runs' seeds), and the held-out reward of greedy captions (words right) at the start and
after each seed's run.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from ernie_moe.config import load_config
from ernie_moe.training import Trainer

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "vl_moe.yaml"
COMMON = ["logging.progress_bar=false", "data.num_eval_samples=64", "training.per_device_train_batch_size=8",
          "training.vit_lr_ratio=1"]
# (router_replay, rl_importance_correction)
WAYS = [("off", "off"), ("off", "tis"), ("off", "mis"), ("rollout", "off"), ("old_policy", "off"),
        ("old_policy", "tis")]


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def grpo(model: Path, out: Path, steps: int, capacity: list[float], replay: str, correction: str, seed: int) -> dict:
    Trainer(load_config(CONFIG, [f"training.seed={seed}",
        *COMMON, "training.stage=grpo", f"training.model_name_or_path={model}", f"training.output_dir={out}",
        "training.rewards=[word_accuracy]", "training.rl_group_size=8", "training.per_device_train_batch_size=64",
        f"training.max_steps={steps}", "training.learning_rate=1e-3", "training.min_lr=1e-4",
        "training.warmup_steps=10", f"training.eval_steps={steps}", "training.eval_generate=true",
        "training.eval_generate_samples=64", "logging.logging_steps=1",
        f"model.moe_capacity=[{', '.join(str(c) for c in capacity)}]", f"training.router_replay={replay}",
        f"training.rl_importance_correction={correction}"])).train()
    steps_logged = [r for r in records(out) if "rl/mismatch_k3" in r]
    evals = [r["eval_generate_reward"] for r in records(out) if "eval_generate_reward" in r]

    def mean(key):
        return sum(r[key] for r in steps_logged) / len(steps_logged)

    return {"mismatch_k3": mean("rl/mismatch_k3"), "past_bound": mean("rl/mismatch_past_bound"),
            "max_ratio": max(r["rl/mismatch_max_ratio"] for r in steps_logged), "corrected": mean("rl/corrected"),
            "reward": evals[-1]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sft-steps", type=int, default=300)
    parser.add_argument("--grpo-steps", type=int, default=200)
    parser.add_argument("--capacity", type=float, nargs=3, default=[1.0, 2.0, 2.0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1])
    parser.add_argument("--model", type=Path, help="a trained folder to start from (else trained here)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model = args.model
        if model is None:
            Trainer(load_config(CONFIG, [
                *COMMON, f"training.max_steps={args.sft_steps}", f"training.eval_steps={args.sft_steps}",
                "training.eval_generate=true", "training.eval_generate_samples=64", "training.rewards=[word_accuracy]",
                f"training.output_dir={work / 'sft'}"])).train()
            model = work / "sft" / "final_model"
            start = [r for r in records(work / "sft") if "eval_generate_reward" in r][-1]["eval_generate_reward"]
            print(f"held-out reward of the start: {start:.3f}")
        print(f"| router_replay | correction | mismatch k3 | past 2x | largest ratio | corrected | reward after "
              f"{args.grpo_steps} (seed {', '.join(map(str, args.seeds))}) |")
        print("|---|---|---|---|---|---|---|")
        for replay, correction in WAYS:
            runs = [grpo(model, work / f"{replay}_{correction}_{seed}", args.grpo_steps, args.capacity, replay,
                         correction, seed) for seed in args.seeds]
            mean = {key: sum(r[key] for r in runs) / len(runs) for key in ("mismatch_k3", "past_bound", "corrected")}
            rewards = ", ".join(f"{r['reward']:.3f}" for r in runs)
            print(f"| {replay} | {correction} | {mean['mismatch_k3']:.2e} | {mean['past_bound']:.2%} | "
                  f"{max(r['max_ratio'] for r in runs):.3g} | {mean['corrected']:.2%} | {rewards} |", flush=True)


if __name__ == "__main__":
    main()
