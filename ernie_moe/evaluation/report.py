"""Two models' answers to the same benchmarks side by side: per benchmark and per category, each model's score,
the difference and its 95% interval, and whether the change is larger than the set's size lets noise be.

The interval is the paired one: both models answered the same questions, so the difference is the mean of the
per-question differences, with the normal interval of that mean (1.96 standard errors, the sample standard
deviation over sqrt(n)), kept within -1 and 1. A change whose interval lies below zero is a regression, above
zero an improvement; one whose interval holds zero is within the noise of a set of this size. With a single
question, or per-question differences all equal, the interval has no width to estimate from and a change is called
only on ten or more questions.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass

from .scoring import units

Z_95 = 1.959963984540054  # the standard normal's 97.5% quantile
MIN_QUESTIONS = 10  # below this a difference without spread is not called a change


@dataclass(frozen=True)
class Row:
    benchmark: str
    scope: str  # "overall", "category/<name>" or "l2_category/<name>"
    questions: int
    before: float
    after: float
    difference: float
    low: float
    high: float
    verdict: str  # "regression", "improvement" or "within noise"
    worse: int = 0  # questions whose score fell (right -> wrong, where scores are 0 or 1)
    better: int = 0  # questions whose score rose (wrong -> right)


def paired(before: dict[str, float], after: dict[str, float]) -> tuple[int, float, float, float]:
    """(questions, mean difference, interval low, high) over the questions both answered."""
    shared = sorted(set(before) & set(after))
    n = len(shared)
    if not n:
        return 0, 0.0, 0.0, 0.0
    diffs = [after[k] - before[k] for k in shared]
    mean = sum(diffs) / n
    if n < 2:
        return n, mean, -1.0, 1.0
    spread = math.sqrt(sum((d - mean) ** 2 for d in diffs) / (n - 1))
    if spread == 0.0 and n < MIN_QUESTIONS:
        return n, mean, -1.0, 1.0
    half = Z_95 * spread / math.sqrt(n)
    return n, mean, max(mean - half, -1.0), min(mean + half, 1.0)  # a difference of scores in [0, 1]


def verdict(low: float, high: float) -> str:
    return "regression" if high < 0 else "improvement" if low > 0 else "within noise"


def compare(before: dict[str, dict], after: dict[str, dict]) -> list[Row]:
    """Rows for each benchmark both results hold (``evaluate --out``'s ``benchmarks``: each with its ``items``),
    overall and per category and l2-category, in the benchmarks' order."""
    rows = []
    for name, first in before.items():
        if name not in after:
            continue
        a, b = units(first["items"]), units(after[name]["items"])
        scopes = {"overall": lambda unit: True}
        for field in ("category", "l2_category"):
            for value in sorted({u[field] for u in a.values() if u[field]}):
                scopes[f"{field}/{value}"] = _in(field, value)
        for scope, member in scopes.items():
            was = {k: u["score"] for k, u in a.items() if member(u)}
            now = {k: u["score"] for k, u in b.items() if k in was}
            n, difference, low, high = paired(was, now)
            if not n:
                continue
            shared = set(was) & set(now)
            rows.append(Row(name, scope, n, sum(was[k] for k in shared) / n, sum(now[k] for k in shared) / n,
                            difference, low, high, verdict(low, high), sum(now[k] < was[k] for k in shared),
                            sum(now[k] > was[k] for k in shared)))
    return rows


def changed_answers(before: dict[str, dict], after: dict[str, dict], limit: int = 3) -> dict[str, dict]:
    """Per benchmark both sides answered, the first ``limit`` questions whose score fell and rose: the question's
    unit, its gold answers and each side's reply and score (from the results' records)."""
    out = {}
    for name, first in before.items():
        if name not in after:
            continue
        was = {r["unit"]: r for r in first["items"]}
        changes: dict[str, list] = {"worse": [], "better": []}
        for record in after[name]["items"]:
            old = was.get(record["unit"])
            if old is None or old["score"] == record["score"]:
                continue
            way = "worse" if record["score"] < old["score"] else "better"
            if len(changes[way]) < limit:
                changes[way].append({"unit": record["unit"], "gold": record.get("gold"),
                                     "before": old.get("reply"), "after": record.get("reply"),
                                     "scores": [old["score"], record["score"]]})
        out[name] = changes
    return out


def as_json(rows: list[Row], before: str, after: str) -> dict:
    return {"before": before, "after": after, "interval": "paired normal 95%", "rows": [asdict(r) for r in rows],
            "regressions": [f"{r.benchmark} {r.scope}" for r in rows if r.verdict == "regression"]}


INTERVAL_NOTE = (
    "change: the mean over the questions both sides answered of (after - before), with its paired 95% interval "
    "(1.96 standard errors of that mean). Below zero throughout: a regression; above: an improvement; holding zero: "
    "within the noise of a set that size. Where every question changed alike the interval has no width (all "
    "right -> wrong reads -1.000 (-1.000 to -1.000)); with fewer than 10 such questions it is -1 to +1 (nothing "
    "called). worse / better: the questions whose score fell / rose (right -> wrong / wrong -> right).")


def as_markdown(rows: list[Row], before: str, after: str, changes: dict[str, dict] | None = None) -> str:
    lines = [f"before: `{before}`  ", f"after: `{after}`", "",
             "| benchmark | scope | questions | before | after | change (95% interval) | worse | better | |",
             "|---|---|---|---|---|---|---|---|---|"]
    marks = {"regression": "**regression**", "improvement": "improvement", "within noise": "within noise"}
    for r in rows:
        lines.append(f"| {r.benchmark} | {r.scope} | {r.questions} | {r.before:.3f} | {r.after:.3f} | "
                     f"{r.difference:+.3f} ({r.low:+.3f} to {r.high:+.3f}) | {r.worse} | {r.better} | "
                     f"{marks[r.verdict]} |")
    lines += ["", INTERVAL_NOTE]
    for name, ways in (changes or {}).items():
        for way, examples in ways.items():
            if examples:
                lines += ["", f"{name}: answers that got {way}", "",
                          "| question | gold | before | after |", "|---|---|---|---|"]
                lines += [f"| {_cell(e['unit'])} | {_cell(e['gold'])} | {_cell(e['before'])} ({e['scores'][0]:g}) | "
                          f"{_cell(e['after'])} ({e['scores'][1]:g}) |" for e in examples]
    return "\n".join(lines) + "\n"


def _cell(value) -> str:
    """A value as one Markdown table cell: one line, pipes escaped, long text cut."""
    text = " / ".join(map(str, value)) if isinstance(value, list) else str(value)
    text = " ".join(text.split()).replace("|", "\\|")
    return text if len(text) <= 80 else text[:79] + "…"


def _in(field: str, value) -> Callable[[dict], bool]:
    """Whether a unit's ``field`` is ``value`` (a category's scope)."""
    return lambda unit: unit[field] == value
