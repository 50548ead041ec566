"""Decoding speed: the key/value cache against running the whole sequence again for every token, and speculative
decoding with the multi-token prediction layers against plain decoding.

    python benchmarks/bench_generate.py [--new-tokens 128] [--rounds 3] [--model DIR]
    python benchmarks/bench_generate.py --mtp [--train-steps 400] [--prompts 16] [--rounds 3] [--model DIR]
    python benchmarks/bench_generate.py --step-costs [--rounds 9]

The default model (``configs/vl_moe.yaml``, randomly initialised unless ``--model`` names a trained folder) with
one held-out synthetic image as the prompt; greedy, no stop at the end token. Tokens per second is the best of
``--rounds`` in one process; the ratio is cached over plain.

``--mtp``: the default model with one multi-token prediction depth, trained here for ``--train-steps`` (or the
folder ``--model``), captions ``--prompts`` held-out images greedily, to the end token, plainly and with 1, 2 and 3
drafts per step, the ways taking turns in each round. It reports the drafts kept, tokens per second (best round) and
their ratio to plain decoding, with and without the prompts' prefill (timed by answering each with one token), and
checks that every way gives the same answers.

``--step-costs``: what speculative decoding's parts cost on a model of ERNIE-4.5-0.3B's shape (dense, text only,
tied embeddings, one MTP depth; random weights, as the costs do not depend on them), after a 64-token prompt: a
forward checking 1 to 8 tokens, the depth over 1 to 8 positions, the head over one, and float32 matmuls of 1 to 8
rows by two of its matrices (median of ``--rounds``, the ways taking turns). From them, for 1 to 7 drafts per
step, the most a step can give over plain decoding (every draft kept) and the share of drafts kept each step needs
for 1.5x: an upper bound, as the host's work (reading the logits back, choosing) is left out.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import warnings
from collections import Counter
from pathlib import Path

import numpy as np
import paddle

from ernie_moe.config import load_config
from ernie_moe.data import build_datasets, build_tokenizer
from ernie_moe.data.feeding.loader import training_encoder
from ernie_moe.data.formats.sample import Chunk, Sample
from ernie_moe.data.formats.synthetic import SyntheticShapes
from ernie_moe.generation import Decoding, generate, generate_drafting, load_model_folder
from ernie_moe.generation.decoding import tokens_inputs
from ernie_moe.generation.kv_cache import KVCache, forward_cached
from ernie_moe.generation.prompts import prompt_encoder
from ernie_moe.generation.speculative import carried_embeddings, drafter
from ernie_moe.model.ernie_vl import ErnieMoEForConditionalGeneration

ROOT = Path(__file__).resolve().parents[1]
DRAFTS = (0, 1, 2, 3)  # drafts per step; 0: plain decoding
# ERNIE-4.5-0.3B's shape (its config.json), dense and text only, with one MTP depth
ERNIE_0_3B = ["model.hidden_size=1024", "model.intermediate_size=3072", "model.num_hidden_layers=18",
              "model.num_attention_heads=16", "model.num_key_value_heads=2", "model.head_dim=128",
              "model.vocab_size=103424", "model.tie_word_embeddings=true", "model.rope_theta=500000",
              "model.rope_3d=false", "model.moe_num_experts=[]", "model.moe_intermediate_size=[]",
              "model.initializer_range=0.02", "model.num_nextn_predict_layers=1"]
FED = range(1, 9)  # tokens a step feeds: the token chosen and up to 7 drafts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, help="rounds timed (default 3; --step-costs: 9)")
    parser.add_argument("--model", help="a trained model folder (default: the default config, random weights)")
    parser.add_argument("--mtp", action="store_true", help="speculative decoding against plain decoding")
    parser.add_argument("--train-steps", type=int, default=400, help="--mtp without --model: steps to train")
    parser.add_argument("--prompts", type=int, default=16, help="--mtp: held-out images captioned")
    parser.add_argument("--step-costs", action="store_true",
                        help="the parts of a speculative step on ERNIE-4.5-0.3B's shape, and the bounds they set")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    if args.step_costs:
        step_costs(args.rounds or 9)
        return
    args.rounds = args.rounds or 3
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


def step_costs(rounds: int) -> None:
    """The parts of a speculative step on ERNIE-4.5-0.3B's shape, timed, and the bounds they set (``--step-costs``)."""
    from ernie_moe.parallel import DistEnv
    from ernie_moe.parallel.cpu_fallbacks import use_avx2_math_on_amd
    from ernie_moe.training.runner import build_model

    use_avx2_math_on_amd()  # as the trainer does, before the first matmul
    cfg = load_config(None, ERNIE_0_3B).model
    paddle.seed(0)
    model = build_model(cfg, DistEnv())
    model.eval()
    mtp = drafter(model)
    assert mtp is not None
    params = sum(int(np.prod(p.shape)) for p in model.parameters())
    channels = cfg.vision_config.in_channels * cfg.vision_config.patch_size ** 2
    prompt = 64
    cache = KVCache(cfg.num_hidden_layers, drafts=1)

    def text(ids: list[int], first: int) -> tuple:
        return tokens_inputs([ids], [list(range(first, first + len(ids)))], [True], channels)

    def back() -> None:  # the cache as after the prompt
        for layer in cache.layers + cache.drafts:
            layer.truncate(prompt)
        cache.length = prompt

    with paddle.no_grad(), carried_embeddings(model):
        inputs = text(list(range(5, 5 + prompt)), 0)
        _, kept = forward_cached(model, inputs, cache, keep=True)
        # the depth's cache over the prompt too, as decoding fills it (the embeddings are not those one ahead here:
        # the costs are the same)
        mtp.decode(kept[0], model.model.embed_tokens(inputs[0]), inputs[1], inputs[2] + 1,
                   cache.bounds(1, prompt, 0), cache.drafts[0])
        hidden = kept[0][:, -1:]

        def check(n: int) -> None:
            back()
            forward_cached(model, text(list(range(7, 7 + n)), prompt), cache).numpy()

        def depth(n: int) -> None:
            back()
            ids = text(list(range(9, 9 + n)), prompt)
            mtp.decode(hidden.tile([1, n, 1]), model.model.embed_tokens(ids[0]), ids[1], ids[2],
                       cache.bounds(1, n), cache.drafts[0]).numpy()

        def head() -> None:
            model.head(model.model.norm(hidden)).numpy()

        head_matrix = model.model.embed_tokens.weight  # tied: the head is x @ E^T
        mlp_matrix = paddle.randn([cfg.intermediate_size, cfg.hidden_size])  # the MLP's down projection's shape

        def matmul(name: str, rows: int) -> None:
            x = paddle.randn([rows, cfg.hidden_size if name == "head" else cfg.intermediate_size])
            if name == "head":
                paddle.matmul(x, head_matrix, transpose_y=True).numpy()
            else:
                paddle.matmul(x, mlp_matrix).numpy()

        ways = {**{("check", n): (check, n) for n in FED}, **{("depth", n): (depth, n) for n in FED},
                ("head", 1): (lambda _: head(), 1), **{(m, n): (lambda r, m=m: matmul(m, r), n)
                                                      for m in ("head", "mlp") for n in (1, 2, 4, 8)}}
        times: dict = {key: [] for key in ways}
        for _ in range(rounds + 1):  # a first round warms up; the ways take turns in each
            for key, (run, n) in ways.items():
                start = time.perf_counter()
                run(n)
                times[key].append(time.perf_counter() - start)
    ms = {key: 1e3 * statistics.median(t[1:]) for key, t in times.items()}
    step = ms["check", 1]
    print(f"ERNIE-4.5-0.3B's shape: {params / 1e6:.0f}M parameters, random weights; after a {prompt}-token prompt, "
          f"median of {rounds} rounds (ms)")
    print(f"{'tokens fed':>10} {'check':>7} {'x step':>7} {'depth':>6}")
    for n in FED:
        print(f"{n:>10} {ms['check', n]:7.1f} {ms['check', n] / step:6.2f}x {ms['depth', n]:6.1f}")
    print(f"head over one position: {ms['head', 1]:.1f} ms")
    print("float32 matmul of 1, 2, 4, 8 rows (ms):")
    for name, shape in (("head", f"x [rows, {cfg.hidden_size}] @ E^T, E [{cfg.vocab_size}, {cfg.hidden_size}]"),
                        ("mlp", f"x [rows, {cfg.intermediate_size}] @ W [{cfg.intermediate_size}, {cfg.hidden_size}]")):
        print(f"  {shape}: " + ", ".join(f"{ms[name, r]:.2f}" for r in (1, 2, 4, 8)))
    print(f"{'drafts/step':>11} {'step cost':>9} {'most':>6} {'kept for 1.5x':>14}")
    for k in range(1, 8):
        # a step: the check of k + 1 tokens, the depth over them, k heads, k - 1 chained passes of the depth
        cost = (ms["check", k + 1] + ms["depth", k + 1] + k * ms["head", 1] + (k - 1) * ms["depth", 1]) / step
        need = kept_for(1.5 * cost, k)
        print(f"{k:>11} {cost:8.2f}x {(k + 1) / cost:5.2f}x {f'{need:.1%}' if need is not None else 'never':>14}")


def kept_for(tokens: float, drafts: int) -> float | None:
    """The share of drafts kept, each independently, at which a step of ``drafts`` drafts gives ``tokens`` tokens on
    average (1 + a + a^2 + ... + a^drafts); None when even every draft kept gives fewer."""
    if tokens > drafts + 1:
        return None
    low, high = 0.0, 1.0
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (mid, high) if sum(mid ** i for i in range(drafts + 1)) < tokens else (low, mid)
    return high


if __name__ == "__main__":
    main()
