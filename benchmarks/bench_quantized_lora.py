"""What holding the base in 8 or 4 bits costs LoRA in quality, on the default task.

    python benchmarks/bench_quantized_lora.py [--base-steps 300] [--lora-steps 200] [section.key=value ...]

A base model is trained on the default task (synthetic image captions) for ``--base-steps``, then LoRA trains
on it for ``--lora-steps`` three times, the same steps and data: on the base as it is (float32 here, bf16 on a
GPU), held in int8 (``wint8``) and in int4 (``wint4``). Prints the final training loss, the held-out loss and the
held-out caption accuracy of each.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
QUIET = ["logging.progress_bar=false", "logging.visualdl=false"]


def train(out: Path, *overrides: str) -> dict:
    command = [sys.executable, str(ROOT / "run_trainer.py"), "--config", str(ROOT / "configs" / "vl_moe.yaml"),
               f"training.output_dir={out}", *QUIET, *overrides]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(done.stderr[-3000:])
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {"loss": [r for r in records if "loss" in r][-1]["loss"], **json.loads((out / "summary.json").read_text())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-steps", type=int, default=300)
    parser.add_argument("--lora-steps", type=int, default=200)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        train(tmp / "base", f"training.max_steps={args.base_steps}", "training.eval_steps=0", *args.overrides)
        rows = []
        for label, bits in (("as loaded", []), ("wint8", ["training.quantize_base=wint8"]),
                            ("wint4", ["training.quantize_base=wint4"])):
            figures = train(tmp / label.replace(" ", "_"), "training.fine_tuning=lora",
                            f"training.model_name_or_path={tmp / 'base' / 'final_model'}",
                            f"training.max_steps={args.lora_steps}", "training.eval_steps=0",
                            "training.warmup_steps=10", *bits, *args.overrides)
            rows.append((label, figures))
    print(f"LoRA for {args.lora_steps} steps on a base trained {args.base_steps} steps (default task)")
    print("| base | final loss | held-out loss | caption accuracy |\n|---|---|---|---|")
    for label, f in rows:
        print(f"| {label} | {f['loss']:.4f} | {f['eval_loss']:.4f} | {f['eval_caption_accuracy']:.3f} |")


if __name__ == "__main__":
    main()
