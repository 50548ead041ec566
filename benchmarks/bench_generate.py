"""Decoding speed with the key/value cache against running the whole sequence again for every token.

    python benchmarks/bench_generate.py [--new-tokens 128] [--rounds 3] [--model DIR]

The default model (``configs/vl_moe.yaml``, randomly initialised unless ``--model`` names a trained folder) with
one held-out synthetic image as the prompt; greedy, no stop at the end token. Tokens per second is the best of
``--rounds`` in one process; the ratio is cached over plain.
"""

from __future__ import annotations

import argparse
import time
import warnings
from collections import Counter
from pathlib import Path

import paddle

from ernie_moe.config import load_config
from ernie_moe.data import build_tokenizer
from ernie_moe.data.packing import Encoder
from ernie_moe.data.sample import Sample
from ernie_moe.data.synthetic import SyntheticShapes
from ernie_moe.generation import generate, load_model_folder
from ernie_moe.model.ernie_vl import ErnieMoEForConditionalGeneration

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model", help="a trained model folder (default: the default config, random weights)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    cfg = load_config(ROOT / "configs" / "vl_moe.yaml")
    if args.model:
        loaded = load_model_folder(args.model)
        model, tokenizer, model_cfg = loaded.model, loaded.tokenizer, loaded.cfg
    else:
        paddle.seed(0)
        model_cfg, tokenizer = cfg.model, build_tokenizer(cfg)
        model = ErnieMoEForConditionalGeneration(model_cfg)
        model.eval()
    sample = SyntheticShapes(cfg.training.seed, "eval", 1, cfg.data.image_size)[0]
    encoder = Encoder(tokenizer, model_cfg, 4096, "skip", cfg.data.max_image_side, Counter())
    prompt = encoder.prompt(Sample(sample.images, sample.chunks[:1]))
    speed = {}
    for use_cache in (True, False):
        best = float("inf")
        for _ in range(args.rounds):
            start = time.perf_counter()
            out = generate(model, prompt, args.new_tokens, eos_id=-1, use_cache=use_cache,
                           never=(model_cfg.im_patch_id,))
            best = min(best, time.perf_counter() - start)
        assert len(out.ids) == args.new_tokens
        speed[use_cache] = args.new_tokens / best
    print(f"prompt {len(prompt)} tokens (one {cfg.data.image_size}px image), {args.new_tokens} new tokens, "
          f"best of {args.rounds}")
    print(f"with the cache:    {speed[True]:8.1f} tokens/s")
    print(f"without the cache: {speed[False]:8.1f} tokens/s")
    print(f"ratio: {speed[True] / speed[False]:.2f}x")


if __name__ == "__main__":
    main()
