"""Decoding speed: the key/value cache against running the whole sequence again for every token, and speculative
decoding with the multi-token prediction layers against plain decoding.

    python benchmarks/bench_generate.py [--new-tokens 128] [--rounds 3] [--model DIR]
    python benchmarks/bench_generate.py --mtp [--train-steps 400] [--prompts 16] [--rounds 3] [--model DIR]

The default model (``configs/vl_moe.yaml``, randomly initialised unless ``--model`` names a trained folder) with
one held-out synthetic image as the prompt; greedy, no stop at the end token. Tokens per second is the best of
``--rounds`` in one process; the ratio is cached over plain.

``--mtp``: the default model with one multi-token prediction depth, trained here for ``--train-steps`` (or the
folder ``--model``), captions ``--prompts`` held-out images greedily, to the end token, plainly and with 1, 2 and 3
drafts per step, the ways taking turns in each round. It reports the drafts kept, tokens per second (best round) and
their ratio to plain decoding, with and without the prompts' prefill (timed by answering each with one token), and
checks that every way gives the same answers.
"""

from __future__ import annotations

import argparse
import tempfile
import time
import warnings
from collections import Counter
from pathlib import Path

import paddle

from ernie_moe.config import load_config
from ernie_moe.data import build_datasets, build_tokenizer
from ernie_moe.data.feeding.loader import training_encoder
from ernie_moe.data.formats.sample import Chunk, Sample
from ernie_moe.data.formats.synthetic import SyntheticShapes
from ernie_moe.generation import Decoding, generate, generate_drafting, load_model_folder
from ernie_moe.generation.prompts import prompt_encoder
from ernie_moe.model.ernie_vl import ErnieMoEForConditionalGeneration

ROOT = Path(__file__).resolve().parents[1]
DRAFTS = (0, 1, 2, 3)  # drafts per step; 0: plain decoding


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model", help="a trained model folder (default: the default config, random weights)")
    parser.add_argument("--mtp", action="store_true", help="speculative decoding against plain decoding")
    parser.add_argument("--train-steps", type=int, default=400, help="--mtp without --model: steps to train")
    parser.add_argument("--prompts", type=int, default=16, help="--mtp: held-out images captioned")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    if args.mtp:
        speculative(args)
    else:
        cache_against_plain(args)


def cache_against_plain(args) -> None:
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
    encoder = prompt_encoder(tokenizer, model_cfg, cfg.data)
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


def speculative(args) -> None:
    cfg = load_config(ROOT / "configs" / "vl_moe.yaml", ["model.num_nextn_predict_layers=1"])
    folder = args.model or trained(cfg, args.train_steps)
    loaded = load_model_folder(folder)
    model, tokenizer = loaded.model, loaded.tokenizer
    _, held_out = build_datasets(load_config(ROOT / "configs" / "vl_moe.yaml"))
    encoder = training_encoder(tokenizer, cfg, Counter())
    prompts = [encoder.prompt(Sample(held_out[i].images, [Chunk(image=0)])) for i in range(args.prompts)]
    never = (loaded.cfg.im_patch_id,)

    def run(drafts: int, new_tokens: int) -> tuple[float, list]:
        start = time.perf_counter()
        outs = [generate_drafting(model, [p], [Decoding(new_tokens)], tokenizer.eos_id, never=never,
                                  tokens=tokenizer.vocab_size, draft_tokens=drafts)[0] for p in prompts]
        return time.perf_counter() - start, outs

    best, prefill, answers = Counter(), Counter(), {}
    for _ in range(args.rounds):  # the ways take turns, so that the machine's load falls on all of them
        for drafts in DRAFTS:
            seconds, outs = run(drafts, 64)
            best[drafts] = min(best[drafts] or seconds, seconds)
            answers[drafts] = outs
            seconds, _ = run(drafts, 1)
            prefill[drafts] = min(prefill[drafts] or seconds, seconds)
    tokens = sum(len(o.ids) for o in answers[0])
    print(f"{args.prompts} held-out images captioned greedily ({tokens} tokens in all, to the end token), "
          f"best of {args.rounds} rounds")
    print(f"{'drafts/step':>11} {'kept':>6} {'tokens/s':>9} {'ratio':>6} {'decode tokens/s':>16} {'ratio':>6}  same")
    plain_speed, plain_decode = tokens / best[0], (tokens - len(prompts)) / (best[0] - prefill[0])
    for drafts in DRAFTS:
        outs = answers[drafts]
        drafted, kept = sum(o.drafted for o in outs), sum(o.accepted for o in outs)
        speed, decode = tokens / best[drafts], (tokens - len(prompts)) / (best[drafts] - prefill[drafts])
        same = [o.ids for o in outs] == [o.ids for o in answers[0]]
        rate = f"{kept / drafted:6.1%}" if drafted else f"{'-':>6}"
        print(f"{drafts or 'plain':>11} {rate} {speed:9.1f} {speed / plain_speed:5.2f}x {decode:16.1f} "
              f"{decode / plain_decode:5.2f}x  {'yes' if same else 'NO'}")


def trained(cfg, steps: int) -> str:
    """The default model with its MTP depth, trained for ``steps`` into a temporary folder: its final model."""
    from ernie_moe.training import Trainer

    out = tempfile.mkdtemp(prefix="bench_mtp_")
    print(f"training the default model with one MTP depth for {steps} steps in {out} ...", flush=True)
    overrides = ["model.num_nextn_predict_layers=1", f"training.max_steps={steps}", "training.eval_steps=0",
                 "data.num_eval_samples=16", "logging.visualdl=false", "logging.progress_bar=false",
                 f"training.output_dir={out}"]
    Trainer(load_config(ROOT / "configs" / "vl_moe.yaml", overrides)).train()
    return str(Path(out) / "final_model")


if __name__ == "__main__":
    main()
