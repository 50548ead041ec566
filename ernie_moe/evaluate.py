"""Score a model folder on held-out data, as the trainer does:
``python -m ernie_moe.evaluate --model DIR --data val.jsonl [--config FILE] [--out FILE.json]`` (``--data``: what
``data.train_path`` takes, a file, a folder of shards or a glob), and on
benchmarks in the field's formats: ``--benchmark KIND:FILE`` (repeatable; ``KIND`` one of
``ernie_moe.evaluation.KINDS``), each answered greedily, several questions side by side, with the prompt and the
answer extraction of the kind's reference harness; ``--out`` then also records each benchmark's file, rule,
decoding settings and every answer.

Samples are encoded as the folder's training encoded them (its ``preprocessor_config.json``: sequence length,
images, videos); ``--config`` names a training config whose sections override that. ``--data synthetic`` takes
the held-out synthetic split of that run (``data.image_size``, ``data.num_eval_samples``, ``training.seed``) and
adds caption accuracy. Prints the loss, token accuracy and (synthetic data) caption accuracy, and writes them as
JSON with ``--out``. One process.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import sys
from collections import Counter
from pathlib import Path

from . import evaluation, json_files
from .checkpoint.errors import CheckpointError
from .cli import bounded
from .config import ConfigError
from .data import DataError, RowStream, rank_batches
from .data.feeding.loader import source_dataset
from .data.formats.synthetic import SyntheticShapes
from .evaluation.results import MAX_NEW_TOKENS, MAX_SIDE_BY_SIDE, benchmark_results
from .evaluation.token_scores import evaluate
from .generation import folder_run_config, load_model_folder
from .parallel import DistEnv
from .paths import check_output, not_a_file, refuse_inputs, write_output


def scores(model_dir, data: str, base, batch_size: int = 8, max_batches: int = 0) -> tuple[dict, dict]:
    """(figures, skipped samples by reason) of the model in ``model_dir`` on ``data``; ``base``: the config
    whose data section and seed apply (its model section is the folder's)."""
    loaded = load_model_folder(model_dir)
    model, tokenizer, model_cfg = loaded.model, loaded.tokenizer, loaded.cfg
    assert tokenizer is not None  # load_model_folder refuses a folder without one unless told otherwise
    if data == "synthetic":
        held_out = SyntheticShapes(base.training.seed, "eval", base.data.num_eval_samples, base.data.image_size,
                                   base.data.blank_images)
    else:  # what data.train_path takes: a file, a folder of shards or a glob of them
        problem = None if Path(data).is_dir() or glob.has_magic(data) else not_a_file(data)
        if problem is not None:
            raise DataError(f"--data file '{data}' {problem}")
        held_out = source_dataset(data, base.data)
    cfg = dataclasses.replace(base, model=model_cfg)
    skipped: Counter = Counter()
    rows = RowStream(held_out, tokenizer, cfg, skipped, shuffle=False)
    return evaluate(model, rank_batches(rows, batch_size, 0, 1, drop_last=False), DistEnv(), max_batches), skipped


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="final model, checkpoint or PaddleFormers ERNIE 4.5 folder")
    parser.add_argument("--data", help="what data.train_path takes (a JSONL file, a folder of .jsonl, WebDataset .tar "
                                       "or Parquet shards, or a glob of them) or 'synthetic'")
    parser.add_argument("--benchmark", action="append", default=[], metavar="KIND:FILE",
                        help=f"a benchmark file and its kind ({', '.join(evaluation.KINDS)}); repeatable")
    parser.add_argument("--config", help="a training config whose data section overrides the folder's settings")
    parser.add_argument("--batch-size", type=bounded(int, 1, MAX_SIDE_BY_SIDE), default=8,
                        help="rows per batch (--data), questions answered side by side (--benchmark)")
    parser.add_argument("--max-batches", type=bounded(int, 0), default=0, help="0 = all")
    parser.add_argument("--max-new-tokens", type=bounded(int, 1, MAX_NEW_TOKENS), default=None,
                        help="the longest answer to a benchmark question (default: the kind's harness default)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--out", help="write the figures (and each benchmark's answers) here as JSON")
    args = parser.parse_args(argv)
    if not args.data and not args.benchmark:
        parser.error("give --data, --benchmark or both")
    result: dict = {}
    try:
        if args.out:  # before any answer: the results over an input would lose it
            refuse_inputs(args.out, [args.model, args.data, args.config,
                                     *(spec.partition(":")[2] for spec in args.benchmark)], "--out")
            check_output(args.out)
        base = folder_run_config(args.model, args.config)
        if args.data:
            figures, skipped = scores(args.model, args.data, base, args.batch_size, args.max_batches)
            if not figures:
                print(f"evaluate error: {args.data} gave nothing to evaluate (skipped samples: "
                      f"{dict(skipped) or 'none'})", file=sys.stderr)
                return 2
            result = {**figures, **{f"skipped/{k}": v for k, v in sorted(skipped.items())}}
            print(" | ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in result.items()))
        if args.benchmark:
            benchmarks = benchmark_results(args.model, args.benchmark, base, args.batch_size, args.max_new_tokens,
                                           progress=not args.no_progress)
            for name, bench in benchmarks.items():
                skipped = sum(bench["skipped_rows"].values()) + sum(bench["skipped_items"].values())
                print(f"{name} ({bench['kind']}): score {bench['score']:.4f} over {bench['count']} questions"
                      + (f", {skipped} skipped" if skipped else ""))
            result["benchmarks"] = benchmarks
    except (CheckpointError, ConfigError, DataError, OSError) as err:
        print(f"evaluate error: {err}", file=sys.stderr)
        return 2
    if args.out:
        try:
            write_output(args.out, json_files.dumps(result, indent=2))
        except OSError as err:
            print(f"evaluate error: cannot write --out: {err}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
