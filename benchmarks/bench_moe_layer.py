"""Time one MoE layer against a dense SwiGLU MLP with the same activated parameters, on the same tokens.

    python benchmarks/bench_moe_layer.py [--tokens 4096 --hidden 256 --experts 8 --k 2 --expert-width 512]

The dense MLP's width is k x expert width, so both do the same matmul work per token; the ratio shows
what routing, sorting, gathering and combining cost on top.
"""

from __future__ import annotations

import argparse
import time

import paddle

from ernie_moe.config import load_config
from ernie_moe.model.init import init_layer
from ernie_moe.model.layers import SwiGLUMLP
from ernie_moe.moe.layer import MoELayer
from ernie_moe.parallel import SingleDevicePlan


def time_fwd_bwd(fn, repeats: int) -> float:
    for _ in range(3):
        fn().sum().backward()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn().sum().backward()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--k", type=int, default=2)
    parser.add_argument("--expert-width", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()

    cfg = load_config(None, [
        f"model.hidden_size={args.hidden}", f"model.moe_num_experts=[{args.experts}]",
        f"model.moe_intermediate_size=[{args.expert_width}]", f"model.moe_k={args.k}",
        "model.moe_num_shared_experts=0",
    ]).model
    paddle.seed(0)
    plan = SingleDevicePlan()
    moe = init_layer(MoELayer(plan, cfg, [0], layer_idx=0))
    dense = init_layer(SwiGLUMLP(plan, args.hidden, args.k * args.expert_width))
    x = paddle.randn([1, args.tokens, args.hidden])
    x.stop_gradient = False
    types = paddle.zeros([1, args.tokens], dtype="int64")

    t_moe = time_fwd_bwd(lambda: moe(x, types)[0], args.repeats)
    t_dense = time_fwd_bwd(lambda: dense(x), args.repeats)
    print(f"tokens {args.tokens}, hidden {args.hidden}, {args.experts} experts, k {args.k}, "
          f"expert width {args.expert_width} (dense width {args.k * args.expert_width})")
    print(f"moe layer fwd+bwd   {t_moe * 1e3:8.2f} ms")
    print(f"dense mlp fwd+bwd   {t_dense * 1e3:8.2f} ms")
    print(f"moe / dense ratio   {t_moe / t_dense:8.2f}")


if __name__ == "__main__":
    main()
