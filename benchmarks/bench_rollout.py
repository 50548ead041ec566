"""Decoding several prompts side by side against one at a time: what a rollout, ``generate --messages`` and the
evaluation by generation do with many prompts.

    python benchmarks/bench_rollout.py [--new-tokens 32] [--sizes 1 8 32] [--rounds 3]

The default model (``configs/vl_moe.yaml``, random weights) with held-out synthetic images and their captions' first
words as prompts of different lengths; greedy, no stop at the end token, so every row decodes ``--new-tokens``.
Tokens per second, the best of ``--rounds`` alternated in one process, for each number of sequences: all of them in
one ``generate_batch`` against each through ``generate`` in turn. The answers are checked equal.
"""

from __future__ import annotations

import argparse
import time
import warnings
from pathlib import Path

import paddle

from ernie_moe.config import load_config
from ernie_moe.data import build_tokenizer
from ernie_moe.data.formats.sample import Sample
from ernie_moe.data.formats.synthetic import SyntheticShapes
from ernie_moe.generation import Decoding, generate, generate_batch
from ernie_moe.generation.prompts import prompt_encoder
from ernie_moe.model.ernie_vl import ErnieMoEForConditionalGeneration
from ernie_moe.parallel.cpu_fallbacks import reuse_freed_host_memory, use_avx2_math_on_amd

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    reuse_freed_host_memory()
    use_avx2_math_on_amd()
    cfg = load_config(ROOT / "configs" / "vl_moe.yaml")
    paddle.seed(0)
    tokenizer = build_tokenizer(cfg)
    model = ErnieMoEForConditionalGeneration(cfg.model)
    model.eval()
    shapes = SyntheticShapes(cfg.training.seed, "eval", max(args.sizes), cfg.data.image_size)
    encoder = prompt_encoder(tokenizer, cfg.model, cfg.data)
    prompts = [encoder.prompt(Sample(shapes[i].images, shapes[i].chunks[: 1 + i % 3])) for i in range(len(shapes))]
    never = (cfg.model.im_patch_id,)
    print(f"{args.new_tokens} new tokens per sequence, prompts of {min(map(len, prompts))}-"
          f"{max(map(len, prompts))} tokens with an image each; tokens/s, best of {args.rounds}\n")
    print("| sequences | side by side (tokens/s) | one at a time (tokens/s) | side by side / one at a time |")
    print("|---|---|---|---|")
    for size in args.sizes:
        group = prompts[:size]
        best = {"batch": float("inf"), "alone": float("inf")}
        for _ in range(args.rounds):
            started = time.perf_counter()
            together = generate_batch(model, group, [Decoding(args.new_tokens)] * size, eos_id=-1, never=never)
            best["batch"] = min(best["batch"], time.perf_counter() - started)
            started = time.perf_counter()
            alone = [generate(model, p, args.new_tokens, eos_id=-1, never=never) for p in group]
            best["alone"] = min(best["alone"], time.perf_counter() - started)
            assert together == alone, "side-by-side answers differ from the answers alone"
        tokens = size * args.new_tokens
        print(f"| {size} | {tokens / best['batch']:.0f} | {tokens / best['alone']:.0f} | "
              f"{best['alone'] / best['batch']:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
