"""Training throughput of a config: tokens/s, step time, model FLOPs, utilisation and peak memory.

    python benchmarks/bench_train.py --config configs/vl_moe.yaml [--steps 30] [section.key=value ...]

Model FLOPs per step count 6 x activated parameters x tokens for the decoder (embedding excluded;
per token its shared experts and k routed experts of its modality), the same for the ViT per patch
and the adapter per merged token, plus causal attention scores. Utilisation divides the achieved
FLOP/s by the peak of a large float32 matmul measured on this machine.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import numpy as np
import paddle

from ernie_moe.config import load_config
from ernie_moe.training import Trainer


def matmul_peak(n: int = 1024, repeats: int = 20) -> float:
    a, b = paddle.randn([n, n]), paddle.randn([n, n])
    paddle.matmul(a, b).numpy()
    start = time.perf_counter()
    for _ in range(repeats):
        c = paddle.matmul(a, b)
    c.numpy()
    return 2 * n**3 * repeats / (time.perf_counter() - start)


def count(layer) -> int:
    return sum(int(np.prod(p.shape)) for p in layer.parameters())


def step_flops(model, cfg, batch) -> float:
    """Forward + backward FLOPs of one micro-batch (6 per activated parameter per token)."""
    m = cfg.model
    types = batch.token_type_ids.numpy()
    text, vision = int((types == 0).sum()), int((types >= 1).sum())
    flops = 0.0
    for layer in model.model.layers:
        attn = count(layer.self_attn)
        tokens = text + vision
        flops += 6 * attn * tokens
        if not layer.is_moe:
            flops += 6 * count(layer.mlp) * tokens
            continue
        moe = layer.mlp
        if moe.shared_experts is not None:
            flops += 6 * count(moe.shared_experts) * tokens
        offset = 0
        for g, size in enumerate(moe.router_counts):
            group_tokens = tokens if moe.group_modality[g] is None else (text if moe.group_modality[g] == 0 else vision)
            per_expert = count(moe.experts[offset])
            flops += 6 * (m.moe_k * per_expert + m.hidden_size * size) * group_tokens
            offset += size
    seq = batch.input_ids.shape[1]
    # causal attention scores and weighted sum: 2 matmuls x 2 FLOPs x half the sequence, forward + backward
    flops += 3 * 2 * 2 * len(model.model.layers) * (seq / 2) * m.num_attention_heads * m.head_dim * (text + vision)
    patches = batch.pixel_patches.shape[0]
    flops += 6 * count(model.vision_model) * patches + 6 * count(model.model.resampler_model) * vision
    return flops


def peak_memory_bytes() -> int:
    if paddle.is_compiled_with_cuda():
        return int(paddle.device.cuda.max_memory_allocated())
    return int(paddle.base.core.host_memory_stat_peak_value("Allocated", 0))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/vl_moe.yaml")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as out:
        cfg = load_config(args.config, [f"training.output_dir={out}", "logging.visualdl=false",
                                        f"training.max_steps={args.steps + args.warmup}", *args.overrides])
        trainer = Trainer(cfg)
        for _ in range(args.warmup):
            trainer.train_step()
        tokens = flops = 0.0
        start = time.perf_counter()
        for _ in range(args.steps):
            micro_batches = trainer.next_micro_batches()
            flops += sum(step_flops(trainer.model, cfg, batch) for batch in micro_batches)
            tokens += trainer.train_step(micro_batches)["tokens"]
        elapsed = time.perf_counter() - start
    peak = matmul_peak()
    achieved = flops / elapsed
    print(f"config {args.config} {' '.join(args.overrides)}")
    print(f"tokens/s           {tokens / elapsed:12.1f}")
    print(f"step time          {elapsed / args.steps * 1e3:12.1f} ms")
    print(f"model FLOPs/token  {flops / tokens:12.3e}")
    print(f"achieved FLOP/s    {achieved:12.3e}")
    print(f"matmul peak        {peak:12.3e}  (float32 1024x1024 on this machine)")
    print(f"utilisation        {achieved / peak:12.1%}")
    print(f"peak memory        {peak_memory_bytes() / 2**20:12.1f} MiB  (Paddle allocator)")


if __name__ == "__main__":
    main()
