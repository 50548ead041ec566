"""Did the fine-tune make the model better? ``python -m ernie_moe.compare --before BASE --after TUNED
--benchmark KIND:FILE [...] --out DIR``.

``BASE`` and ``TUNED`` are model folders (final models, checkpoints, LoRA adapters over their base), each
answering every ``--benchmark`` as ``python -m ernie_moe.evaluate`` does, or results files that command wrote
(``--out``), read as they are. ``DIR`` gets ``report.json``, ``report.md`` and ``report.png``: every benchmark
and category side by side, the change with its paired 95% interval, regressions flagged
(``ernie_moe.evaluation.report``); and each side's results (``before.json``, ``after.json``). Exit code 0, or 1
when any benchmark or category regressed, or a benchmark is on one side only (``--fail-on-regression``). No
report file is written over an input.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from PIL import Image

from . import json_files
from .checkpoint.errors import CheckpointError
from .cli import bounded
from .config import ConfigError
from .data import DataError
from .evaluation.report import as_json, as_markdown, changed_answers, compare
from .evaluation.results import MAX_NEW_TOKENS, MAX_SIDE_BY_SIDE, benchmark_results
from .generation import folder_run_config
from .monitor.charts import comparison_chart
from .paths import check_output, refuse_inputs, write_output

REPORT_FILES = ("report.json", "report.md", "report.png", "before.json", "after.json")
MAX_RESULTS_BYTES = 1 << 30  # a results file is read whole; one of a million answers is far below this


def side(source: str, specs: list[str], config: str | None, batch_size: int, max_new_tokens: int | None) -> dict:
    """A side's results by benchmark: read from an ``evaluate --out`` file, or answered by a model folder."""
    path = Path(source)
    if path.is_file():
        try:
            results = json_files.read_json_object(path, DataError, MAX_RESULTS_BYTES).get("benchmarks")
        except DataError as err:
            raise DataError(f"'{path}' is not a results file of python -m ernie_moe.evaluate: {err}") from None
        if not isinstance(results, dict) or not all(isinstance(r, dict) and isinstance(r.get("items"), list)
                                                     for r in results.values()):
            raise DataError(f"'{path}' holds no benchmark answers (write it with evaluate --benchmark ... --out)")
        for name, result in results.items():
            for number, item in enumerate(result["items"], start=1):
                problem = item_problem(item)
                if problem:
                    raise DataError(f"'{path}': benchmark {name}, item {number}: {problem} (evaluate --out writes "
                                    "each item with its unit, a score from 0 to 1 and its categories)")
        return results
    if not path.exists():
        raise DataError(f"'{source}' does not exist (give a model folder, or an evaluate --out file)")
    if not path.is_dir():
        raise DataError(f"'{source}' is neither a model folder nor a results file of evaluate --out")
    if not specs:
        raise DataError(f"'{source}' is a model folder: give the --benchmark files to answer")
    return benchmark_results(source, specs, folder_run_config(source, config), batch_size, max_new_tokens)


def item_problem(item) -> str | None:
    """What makes a results file's item unreadable as a scored answer, or None."""
    if not isinstance(item, dict):
        return f"{type(item).__name__} where an object was expected"
    unit = item.get("unit")
    if isinstance(unit, bool) or not isinstance(unit, (str, int)):
        return f"unit {unit!r} (a question's name or number is expected)"
    score = item.get("score")
    if isinstance(score, bool) or not isinstance(score, (int, float)) or not 0 <= score <= 1:
        return f"score {score!r} (a number from 0 to 1 is expected; NaN is none)"
    for field in ("category", "l2_category"):
        if item.get(field) is not None and not isinstance(item[field], str):
            return f"{field} {item[field]!r} (a name is expected)"
    return None


def short(path: str) -> str:
    """A side's name for the chart: its last two path parts (``run/final_model``)."""
    return "/".join(Path(path).resolve().parts[-2:])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", required=True, help="the base: a model folder, or an evaluate --out file")
    parser.add_argument("--after", required=True, help="the fine-tuned model: a folder, or an evaluate --out file")
    parser.add_argument("--benchmark", action="append", default=[], metavar="KIND:FILE",
                        help="a benchmark file and its kind, answered by each model folder; repeatable")
    parser.add_argument("--out", required=True, help="the report's folder")
    parser.add_argument("--config", help="a training config whose data section overrides the folders' settings")
    parser.add_argument("--batch-size", type=bounded(int, 1, MAX_SIDE_BY_SIDE), default=8)
    parser.add_argument("--max-new-tokens", type=bounded(int, 1, MAX_NEW_TOKENS), default=None)
    parser.add_argument("--fail-on-regression", action="store_true",
                        help="exit 1 when anything regressed, or a benchmark is on one side only")
    args = parser.parse_args(argv)
    try:
        before, after = (side(s, args.benchmark, args.config, args.batch_size, args.max_new_tokens)
                         for s in (args.before, args.after))
        refuse_inputs(args.out, [args.before, args.after, *(spec.partition(":")[2] for spec in args.benchmark)],
                      "--out")
        out = Path(args.out)
        for name in REPORT_FILES:  # the report's files over one of the inputs (before.json given as --before)
            refuse_inputs(out / name, [args.before, args.after], "--out's")
        rows = compare(before, after)
        if not rows:
            raise DataError("the two sides share no benchmark question")
        out.mkdir(parents=True, exist_ok=True)
        one_sided = {"before only": sorted(set(before) - set(after)), "after only": sorted(set(after) - set(before))}
        report = {**as_json(rows, args.before, args.after), "one_sided": one_sided}
        changes = changed_answers(before, after)
        report["changed_answers"] = changes
        write_output(out / "report.json", json_files.dumps(report, indent=2))
        write_output(out / "report.md", as_markdown(rows, args.before, args.after, changes))
        for name, results in (("before.json", before), ("after.json", after)):
            write_output(out / name, json_files.dumps({"benchmarks": results}, indent=2))
        chart = comparison_chart([(f"{r.benchmark} {r.scope}", r.before, r.after, r.low, r.high) for r in rows],
                                 f"{short(args.before)} -> {short(args.after)}")
        check_output(out / "report.png")
        Image.fromarray(chart).save(out / "report.png")
    except (CheckpointError, ConfigError, DataError, OSError) as err:
        print(f"compare error: {err}", file=sys.stderr)
        return 2
    print(as_markdown(rows, args.before, args.after, changes), end="")
    flagged = report["regressions"]
    if flagged:
        print(f"regressions: {', '.join(flagged)}")
    missing = [f"{name} ({side})" for side, names in one_sided.items() for name in names]
    if missing:
        print(f"benchmarks on one side only, not compared: {', '.join(missing)}")
    print(f"report written to {out}/report.md, report.json and report.png")
    return 1 if (flagged or missing) and args.fail_on_regression else 0


if __name__ == "__main__":
    sys.exit(main())
