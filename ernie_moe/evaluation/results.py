"""A model folder's answers to benchmark files, scored: what ``python -m ernie_moe.evaluate --benchmark`` and
``python -m ernie_moe.compare`` write."""

from __future__ import annotations

import sys

from tqdm import tqdm

from ..data import DataError
from ..data.encoding.tokenizer import Tokenizer, unknown_warning
from ..generation import load_model_folder
from .answering import answer_benchmark
from .formats import KINDS, Benchmark, read_benchmark
from .scoring import RULES, max_new_tokens, prompt_text

MAX_SIDE_BY_SIDE = 1024  # rows or questions at once: far above what fits a CPU's memory for the default model
MAX_NEW_TOKENS = 65536


def read_benchmarks(specs: list[str], where: str = "--benchmark") -> dict[str, Benchmark]:
    """Each ``KIND:FILE`` of ``specs`` read, by its file's stem (DataError for two files of one stem; ``where``
    names the setting in messages)."""
    benches: dict[str, Benchmark] = {}
    for spec in specs:
        kind, sep, path = spec.partition(":")
        if not sep or kind not in KINDS:
            raise DataError(f"{where} '{spec}' must be KIND:FILE, KIND one of {', '.join(KINDS)}")
        bench = read_benchmark(path, kind)
        if bench.path.stem in benches:
            raise DataError(f"{where} names two benchmarks called '{bench.path.stem}': name them apart, or give "
                            "the folder that holds them (KIND:FOLDER, or a glob) to read them as one benchmark")
        benches[bench.path.stem] = bench
    return benches


def unknown_warnings(benches: dict[str, Benchmark], tokenizer: Tokenizer) -> list[str]:
    """A line for each benchmark whose questions the tokenizer reads largely as its unknown token (a model whose
    vocabulary does not cover them answers placeholders, and scores nothing)."""
    lines = []
    for name, bench in benches.items():
        unknown = tokens = 0
        for item in bench.items:
            ids = tokenizer.encode(prompt_text(bench.kind, item))
            unknown, tokens = unknown + ids.count(tokenizer.unk_id), tokens + len(ids)
        line = unknown_warning(unknown / tokens if tokens else 0.0, f"benchmark {name}'s questions")
        if line:
            lines.append(line)
    return lines


def benchmark_results(model_dir, specs: list[str], base, batch_size: int, answer_tokens: int | None,
                      progress: bool = True) -> dict:
    """Each ``KIND:FILE`` of ``specs`` answered by the model in ``model_dir`` (``answer_tokens`` at most, None:
    the kind's default) and scored: its figures, rule, decoding settings, skipped items and every answer, by the
    benchmark's name (the file's stem)."""
    benches = read_benchmarks(specs)
    loaded = load_model_folder(model_dir)
    assert loaded.tokenizer is not None  # load_model_folder refuses a folder without one unless told
    for line in unknown_warnings(benches, loaded.tokenizer):
        print(f"warning: {line}", file=sys.stderr)
    results = {}
    for name, bench in benches.items():
        tokens = answer_tokens or max_new_tokens(bench.kind)
        with tqdm(total=len(bench.items), desc=name, unit="question", disable=not progress, file=sys.stderr) as bar:
            assert loaded.tokenizer is not None  # load_model_folder refuses a folder without one unless told
            answered = answer_benchmark(loaded.model, loaded.tokenizer, base.data, bench, tokens, batch_size,
                                        on_answers=bar.update, sees_images=loaded.sees_images)
        if not answered.figures:
            raise DataError(f"benchmark '{bench.path}': no question could be asked (skipped: "
                            f"{dict(answered.skipped)})")
        results[name] = {"kind": bench.kind, "file": str(bench.path), "rule": RULES[bench.kind],
                         "decoding": {"greedy": True, "max_new_tokens": tokens, "side_by_side": batch_size},
                         **answered.figures, "skipped_rows": dict(bench.skipped),
                         "skipped_items": dict(answered.skipped), "items": answered.items}
    return results
