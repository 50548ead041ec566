"""Benchmarks answered at every evaluation (``training.eval_benchmarks``): each file read once at start, each data
rank answering its share of the questions with the whole model, the scores summed over the data ranks:
``eval_bench/<file's stem>``, and per category and l2-category under it."""

from __future__ import annotations

import paddle

from ..data.encoding.tokenizer import Tokenizer
from ..parallel.env import DistEnv
from ..parallel.pipeline import TrainedModel
from .answering import answer_benchmark
from .formats import Benchmark
from .generated import SIDE_BY_SIDE
from .scoring import max_new_tokens


def benchmark_metrics(benches: dict[str, Benchmark], model: TrainedModel, tokenizer: Tokenizer, data_cfg,
                      env: DistEnv) -> dict:
    """Every benchmark's figures as ``eval_bench/<name>[/<category>]``, and its skipped items."""
    def summed(values):
        return env.all_reduce_sum(paddle.to_tensor(values), env.data_group).numpy()

    result = {}
    for name, bench in benches.items():
        answered = answer_benchmark(model, tokenizer, data_cfg, bench, max_new_tokens(bench.kind), SIDE_BY_SIDE,
                                    env.data_rank, env.data_world, summed)
        figures = dict(answered.figures)
        result.update({f"eval_bench/{name}/skipped_{reason}": n for reason, n in answered.skipped.items()})
        if not figures:  # no score to log: say why, where the run is watched
            if env.is_main:
                print(f"warning: benchmark {name} ({bench.path}): no question could be asked at this evaluation "
                      f"(skipped: {dict(answered.skipped) or 'none'}), so eval_bench/{name} has no figure",
                      flush=True)
            continue
        result[f"eval_bench/{name}"] = figures.pop("score")
        figures.pop("count")
        result.update({f"eval_bench/{name}/{key}": value for key, value in figures.items()})
    return result
