"""Time and allocator peak of one packed-document causal attention, forward and backward: FlashMask's row bounds
through the block path (``nn.flashmask``) against a dense boolean mask through Paddle's attention.

    python benchmarks/bench_attention.py [--repeats 5] [--tokens 1024 2048 4096]

One row of packed documents (a half, a quarter, an eighth of the row and the rest), 4 heads and 2 key/value heads
of 32, float32 on the CPU: the time is the median of ``--repeats`` runs after one warm-up; the peak is Paddle's
allocator peak of one run above what was allocated before it. Ratios are block path over dense mask.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import paddle
import paddle.nn.functional as F
from paddle.base import core

from ernie_moe.data.encoding.packing import document_ends
from ernie_moe.nn.flashmask import RowBounds, block_attention

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 32


def documents(tokens: int) -> np.ndarray:
    lengths = [tokens // 2, tokens // 4, tokens // 8]
    lengths.append(tokens - sum(lengths))
    return np.repeat(np.arange(len(lengths)), lengths)


def run(tokens: int, dense: bool, rng) -> float:
    """Seconds of one forward and backward."""
    q = paddle.to_tensor(rng.standard_normal([1, tokens, HEADS, HEAD_DIM]).astype("float32"))
    k, v = (paddle.to_tensor(rng.standard_normal([1, tokens, KV_HEADS, HEAD_DIM]).astype("float32")) for _ in "kv")
    for t in (q, k, v):
        t.stop_gradient = False
    bounds = RowBounds(paddle.to_tensor(document_ends(documents(tokens))[None]))
    started = time.perf_counter()
    if dense:  # what attention took before: the [seq, seq] mask, keys and values repeated to every head
        repeat = HEADS // KV_HEADS
        out = F.scaled_dot_product_attention(q, paddle.repeat_interleave(k, repeat, axis=2),
                                             paddle.repeat_interleave(v, repeat, axis=2),
                                             attn_mask=bounds.dense(tokens))
    else:
        out = block_attention(q, k, v, bounds)
    out.sum().backward()
    return time.perf_counter() - started


def measure(tokens: int, dense: bool, repeats: int) -> tuple[float, float]:
    rng = np.random.default_rng(0)
    run(tokens, dense, rng)
    times = [run(tokens, dense, rng) for _ in range(repeats)]
    base = core.host_memory_stat_current_value("Allocated", 0)
    core.host_memory_stat_reset_peak_value("Allocated", 0)
    run(tokens, dense, rng)
    return statistics.median(times), (core.host_memory_stat_peak_value("Allocated", 0) - base) / 2 ** 20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 2048, 4096])
    args = parser.parse_args()
    print(f"{'tokens':>7} {'block ms':>9} {'dense ms':>9} {'x time':>7} {'block MiB':>10} {'dense MiB':>10} "
          f"{'x peak':>7}")
    for tokens in args.tokens:
        block_time, block_peak = measure(tokens, False, args.repeats)
        dense_time, dense_peak = measure(tokens, True, args.repeats)
        print(f"{tokens:>7} {block_time * 1e3:9.1f} {dense_time * 1e3:9.1f} {block_time / dense_time:7.2f} "
              f"{block_peak:10.1f} {dense_peak:10.1f} {block_peak / dense_peak:7.2f}")


if __name__ == "__main__":
    main()
