"""Time one MoE layer against a dense SwiGLU MLP with the same activated parameters, on the same tokens.

    python benchmarks/bench_moe_layer.py                 # ERNIE's fine-grained case and a coarse one, one run
    python benchmarks/bench_moe_layer.py --tokens 4096 --hidden 256 --experts 64 --k 8 --expert-width 128

The dense MLP's width is k x expert width, so both do the same matmul work per token; the ratio shows what
routing, sorting, gathering and combining cost on top. The MoE layer runs its experts both ways
(``training.moe_expert_matmul``): one after another, and grouped (one kernel per projection: Paddle's grouped
GEMM on a GPU, a padded batched matmul on a CPU).
Each repeat times every variant once, in turn, and each keeps its fastest, so load drift on a shared
machine hits all of them alike. A second table splits the per-expert layer into its experts alone (on the
layer's own sorted rows; also through autograd expert by expert, split and concatenated, the path LoRA experts
take) and everything else (router, router losses, sorting, gathering and the weighted combine, with the
experts skipped).
"""

from __future__ import annotations

import argparse
import time

import paddle

from ernie_moe.config import load_config
from ernie_moe.moe.experts import use_expert_matmul
from ernie_moe.moe.layer import MoELayer
from ernie_moe.nn.init import init_layer
from ernie_moe.nn.layers import SwiGLUMLP
from ernie_moe.parallel import SingleDevicePlan
from ernie_moe.parallel.cpu_fallbacks import reuse_freed_host_memory, use_avx2_math_on_amd

# (experts, k, expert width): ERNIE-4.5's fine-grained routing (8 of 64), and a coarse layer (2 of 8)
CASES = [(64, 8, 128), (8, 2, 512)]


def fwd_bwd_seconds(fn) -> float:
    start = time.perf_counter()
    fn().sum().backward()
    return time.perf_counter() - start


def measure(tokens: int, hidden: int, experts: int, k: int, width: int, repeats: int) -> dict[str, float]:
    cfg = load_config(None, [
        f"model.hidden_size={hidden}", f"model.moe_num_experts=[{experts}]",
        f"model.moe_intermediate_size=[{width}]", f"model.moe_k={k}", "model.moe_num_shared_experts=0",
    ]).model
    paddle.seed(0)
    plan = SingleDevicePlan()
    moe = init_layer(MoELayer(plan, cfg, [0], layer_idx=0))
    dense = init_layer(SwiGLUMLP(plan, hidden, k * width))
    x = paddle.randn([1, tokens, hidden])
    x.stop_gradient = False
    types = paddle.zeros([1, tokens], dtype="int64")

    def moe_run(mode):
        def run():
            use_expert_matmul(moe, mode)
            return moe(x, types)[0]
        return run

    flat = x.reshape([tokens, hidden]).detach()
    flat.stop_gradient = False
    every_token = paddle.arange(tokens)
    routing = moe.gate(flat, every_token, 0, None)
    rows, counts, _ = moe.dispatcher.dispatch(flat, every_token, routing.expert_ids, routing.weights, experts, None)
    rows = rows.detach()
    rows.stop_gradient = False

    def without_experts():
        routing = moe.gate(flat, every_token, 0, None)
        routed, _, state = moe.dispatcher.dispatch(flat, every_token, routing.expert_ids, routing.weights,
                                                   experts, None)
        return moe.dispatcher.combine(routed, state, tokens) + paddle.add_n(list(moe.gate.losses(routing, 0).values()))

    def experts_alone():
        use_expert_matmul(moe, "per_expert")
        return moe.experts(rows, counts)[0]

    def experts_through_autograd():
        return moe.experts.autograd_loop(rows, counts)[0]

    variants = {"per_expert": moe_run("per_expert"), "grouped": moe_run("grouped"), "dense": lambda: dense(x),
                "without_experts": without_experts, "experts_alone": experts_alone,
                "experts_autograd": experts_through_autograd}
    for fn in variants.values():  # warm-up
        for _ in range(2):
            fwd_bwd_seconds(fn)
    best = {name: float("inf") for name in variants}
    for _ in range(repeats):
        for name, fn in variants.items():
            best[name] = min(best[name], fwd_bwd_seconds(fn))
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--experts", type=int, help="one case of this many experts (default: both cases)")
    parser.add_argument("--k", type=int, default=2)
    parser.add_argument("--expert-width", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    cases = [(args.experts, args.k, args.expert_width)] if args.experts else CASES
    if paddle.device.get_device() == "cpu":  # as the trainer does on a CPU
        if reuse_freed_host_memory():
            print("host memory: freed blocks reused")
        if use_avx2_math_on_amd():
            print("math: MKL's AVX2 path on this AMD CPU")
    print(f"tokens {args.tokens}, hidden {args.hidden}, fwd+bwd, fastest of {args.repeats}; "
          "dense width = k x expert width\n")
    print("| experts | k | expert width | per expert (ms) | grouped (ms) | dense (ms) | MoE / dense, per expert "
          "| MoE / dense, grouped |")
    print("|---|---|---|---|---|---|---|---|")
    times = {}
    for experts, k, width in cases:
        t = times[experts, k, width] = measure(args.tokens, args.hidden, experts, k, width, args.repeats)
        print(f"| {experts} | {k} | {width} | {t['per_expert'] * 1e3:.1f} | {t['grouped'] * 1e3:.1f} | "
              f"{t['dense'] * 1e3:.1f} | {t['per_expert'] / t['dense']:.2f} | {t['grouped'] / t['dense']:.2f} |",
              flush=True)
    print("\n| experts | k | expert width | experts alone (ms) | the same through autograd (ms) "
          "| router, losses, dispatch, combine (ms) | per-expert layer (ms) | dense (ms) |")
    print("|---|---|---|---|---|---|---|---|")
    for (experts, k, width), t in times.items():
        print(f"| {experts} | {k} | {width} | {t['experts_alone'] * 1e3:.1f} | {t['experts_autograd'] * 1e3:.1f} | "
              f"{t['without_experts'] * 1e3:.1f} | {t['per_expert'] * 1e3:.1f} | {t['dense'] * 1e3:.1f} |")


if __name__ == "__main__":
    main()
