"""This package's dense decoder against PaddleFormers' ``Ernie4_5ForCausalLM`` at the same shape: training tokens/s.

    python benchmarks/bench_dense.py [--rounds 5] [--steps 10]

Both models are built in this process from one shape (hidden size, layers, heads, key/value heads, head width,
MLP width, vocabulary; untied head, text only) and trained on the same random token batch: forward, the mean
cross-entropy over every next token, backward, one AdamW step. Rounds of ``--steps`` steps alternate between the
two models, so that load on a shared machine falls on both; each model's median round is reported. Two shapes:
the default config's language model (``configs/vl_moe.yaml``: 8 rows of 64 tokens) and a wider one.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import paddle

# (name, hidden, layers, heads, kv heads, head dim, MLP width, vocabulary, rows, tokens per row)
SHAPES = [("default config", 64, 2, 4, 2, 16, 128, 32, 8, 64),
          ("wider", 256, 4, 8, 4, 32, 1024, 1024, 4, 256)]


def ours(hidden, layers, heads, kv_heads, head_dim, width, vocab):
    """This package's model from the shape, dense and text-only, as a training step function."""
    from ernie_moe.batch import Batch, HostCounts
    from ernie_moe.config import load_config
    from ernie_moe.parallel import DistEnv
    from ernie_moe.training.runner import build_model

    cfg = load_config(None, [f"model.hidden_size={hidden}", f"model.num_hidden_layers={layers}",
                             f"model.num_attention_heads={heads}", f"model.num_key_value_heads={kv_heads}",
                             f"model.head_dim={head_dim}", f"model.intermediate_size={width}",
                             f"model.vocab_size={vocab}", "model.moe_num_experts=[]", "model.moe_intermediate_size=[]",
                             "model.tie_word_embeddings=false", "model.rope_3d=false"]).model
    model = build_model(cfg, DistEnv())
    optimizer = paddle.optimizer.AdamW(parameters=model.parameters(), learning_rate=1e-4)

    def step(ids: np.ndarray, labels: np.ndarray) -> None:
        rows, seq = ids.shape
        positions = np.broadcast_to(np.arange(seq)[None, :, None], [rows, seq, 3]).copy()
        types = np.zeros([rows, seq], np.int64)
        batch = Batch(paddle.to_tensor(ids), paddle.to_tensor(labels), paddle.to_tensor(types),
                      paddle.to_tensor(positions), paddle.full([rows, seq], seq, "int64"), paddle.zeros([0, 588]),
                      np.zeros([0, 3], np.int64), counts=HostCounts.of(labels, types))
        out = model(batch)
        (out.loss_sum / batch.counts.label_tokens + out.router_loss).backward()
        optimizer.step()
        optimizer.clear_grad()

    return step


def theirs(hidden, layers, heads, kv_heads, head_dim, width, vocab):
    """PaddleFormers' ``Ernie4_5ForCausalLM`` of the shape (its CPU forward needs ``fuse_rms_norm`` off)."""
    from paddleformers.transformers import Ernie4_5Config, Ernie4_5ForCausalLM

    config = Ernie4_5Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=width, num_hidden_layers=layers,
                            num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                            max_position_embeddings=4096, rms_norm_eps=1e-5, fuse_rms_norm=False,
                            tie_word_embeddings=False)
    model = Ernie4_5ForCausalLM(config)
    optimizer = paddle.optimizer.AdamW(parameters=model.parameters(), learning_rate=1e-4)

    def step(ids: np.ndarray, labels: np.ndarray) -> None:
        out = model(input_ids=paddle.to_tensor(ids), labels=paddle.to_tensor(labels), return_dict=True)
        out.loss.backward()
        optimizer.step()
        optimizer.clear_grad()

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    from ernie_moe.parallel.cpu_fallbacks import use_avx2_math_on_amd

    use_avx2_math_on_amd()  # as the trainer does, before the first matmul
    print("| shape | rows x tokens | ours (tokens/s) | PaddleFormers (tokens/s) | ours / PaddleFormers |")
    print("|---|---|---|---|---|")
    for name, *shape, rows, seq in SHAPES:
        paddle.seed(0)
        rng = np.random.default_rng(0)
        ids = rng.integers(0, shape[-1], [rows, seq]).astype("int64")
        labels = np.concatenate([ids[:, 1:], np.full([rows, 1], -100, np.int64)], axis=1)
        steps = {"ours": ours(*shape), "PaddleFormers": theirs(*shape)}
        for step in steps.values():  # warm-up
            for _ in range(3):
                step(ids, labels)
        rates: dict[str, list[float]] = {model: [] for model in steps}
        for _ in range(args.rounds):
            for model, step in steps.items():
                start = time.perf_counter()
                for _ in range(args.steps):
                    step(ids, labels)
                rates[model].append(rows * seq * args.steps / (time.perf_counter() - start))
        a, b = (statistics.median(rates[m]) for m in ("ours", "PaddleFormers"))
        print(f"| {name} | {rows} x {seq} | {a:.0f} | {b:.0f} | {a / b:.2f} |", flush=True)


if __name__ == "__main__":
    main()
