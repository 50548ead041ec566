"""What a checkpoint costs the training step, written synchronously and in the background, alternated in one run.

    python benchmarks/bench_checkpoint.py [--rounds 5] [section.key=value ...]

The default config widened to about 250 MB of checkpointed state (weights and AdamW moments, float32). Each round
saves once synchronously (the step waits for the files, their fsync and fingerprints) and once with
``training.async_save`` (the step waits for the copy of the state to host memory; a thread writes the files),
after a training step each, so both save the same kind of state. Reported: the medians of the step's stall per
save, their ratio, how long the background write took to complete, and a training step's time alone and while a
background write runs beside it.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from ernie_moe.checkpoint.files import BackgroundWrites
from ernie_moe.config import load_config
from ernie_moe.training import Trainer

WIDE = ["model.hidden_size=512", "model.intermediate_size=1024", "model.num_hidden_layers=4",
        "model.num_attention_heads=8", "model.num_key_value_heads=4", "model.moe_intermediate_size=[512,256]",
        "model.vocab_size=4096"]


def seconds(run) -> float:
    started = time.perf_counter()
    run()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=".") as out:
        cfg = load_config("configs/vl_moe.yaml", [
            f"training.output_dir={out}", "logging.visualdl=false", "logging.progress_bar=false",
            "training.save_total_limit=2", f"training.max_steps={4 * args.rounds + 10}", *WIDE, *args.overrides])
        trainer = Trainer(cfg)
        background = BackgroundWrites()

        def step() -> float:
            trainer.step += 1
            return seconds(trainer.train_step)

        def save(writes) -> float:
            trainer.saves.writes = writes
            return seconds(trainer.saves.save)

        for _ in range(2):  # warm-up: the allocator, the optimizer's states, the first files
            step()
        save(None)
        state = sum(f.stat().st_size for f in trainer.saves.last.path.glob("*.safetensors"))
        stalls: dict[str, list[float]] = {"sync": [], "async": []}
        written, alone, beside = [], [], []
        for _ in range(args.rounds):
            alone.append(step())
            stalls["sync"].append(save(None))
            step()
            stalls["async"].append(save(background))
            beside.append(step())  # the writer's thread runs beside this step
            written.append(stalls["async"][-1] + beside[-1] + seconds(trainer.saves.finish))
        trainer.parts.feed.close()
        median = {mode: statistics.median(values) for mode, values in stalls.items()}
        print(f"{state / 1e6:.0f} MB of state in {Path(trainer.saves.last.path).name}'s tensor files; "
              f"medians of {args.rounds} alternated rounds:")
        print(f"| save | step stall per save (s) |\n|---|---|\n| synchronous | {median['sync']:.3f} |\n"
              f"| background (training.async_save) | {median['async']:.3f} |")
        print(f"stall, background / synchronous: {median['async'] / median['sync']:.1%}; the background write "
              f"completes {statistics.median(written):.3f} s after its save starts; a training step takes "
              f"{statistics.median(alone):.3f} s alone, {statistics.median(beside):.3f} s beside a background write")


if __name__ == "__main__":
    main()
