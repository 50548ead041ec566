"""Draft acceptance through GRPO: the multi-token prediction depth trained on the sampled answers, or left as it was.

    python benchmarks/bench_rl_mtp.py [--sft-steps 300] [--grpo-steps 200]

A captioner with one multi-token prediction depth trained here for ``--sft-steps`` supervised steps (8 rows a step,
the ViT at the base rate: the README's GRPO start), then GRPO runs of ``--grpo-steps`` from it with the depth trained
beside the policy (``training.rl_train_mtp``) and frozen. Each reports the held-out draft acceptance
(``eval_draft_acceptance``: greedy captions of 64 held-out images decoded with one draft a step, the share of drafts
the model's own greedy choice kept) and reward (words right) before GRPO and after it.
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
          "training.vit_lr_ratio=1", "model.num_nextn_predict_layers=1", "training.eval_generate=true",
          "training.eval_generate_samples=64", "training.rewards=[word_accuracy]"]


def last_eval(out: Path) -> dict:
    evals = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "eval_loss" in r]
    return evals[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sft-steps", type=int, default=300)
    parser.add_argument("--grpo-steps", type=int, default=200)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        Trainer(load_config(CONFIG, [*COMMON, f"training.max_steps={args.sft_steps}",
                                     f"training.eval_steps={args.sft_steps}",
                                     f"training.output_dir={work / 'sft'}"])).train()
        before = last_eval(work / "sft")
        print("| MTP depth in GRPO | draft acceptance | held-out reward |")
        print("|---|---|---|")
        print(f"| before GRPO | {before['eval_draft_acceptance']:.3f} | {before['eval_generate_reward']:.3f} |",
              flush=True)
        for name, overrides in (("trained", ["training.rl_train_mtp=true"]), ("frozen", ["training.freeze=[mtp]"])):
            out = work / name
            Trainer(load_config(CONFIG, [
                *COMMON, "training.stage=grpo", f"training.model_name_or_path={work / 'sft' / 'final_model'}",
                f"training.output_dir={out}", "training.rl_group_size=8", "training.per_device_train_batch_size=64",
                f"training.max_steps={args.grpo_steps}", "training.learning_rate=1e-3", "training.min_lr=1e-4",
                "training.warmup_steps=10", f"training.eval_steps={args.grpo_steps}", *overrides])).train()
            after = last_eval(out)
            print(f"| {name}, after {args.grpo_steps} steps | {after['eval_draft_acceptance']:.3f} | "
                  f"{after['eval_generate_reward']:.3f} |", flush=True)


if __name__ == "__main__":
    main()
