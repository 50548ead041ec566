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
                            difference, low, high, verdict(low, high)))
    return rows


def as_json(rows: list[Row], before: str, after: str) -> dict:
    return {"before": before, "after": after, "interval": "paired normal 95%", "rows": [asdict(r) for r in rows],
            "regressions": [f"{r.benchmark} {r.scope}" for r in rows if r.verdict == "regression"]}


def as_markdown(rows: list[Row], before: str, after: str) -> str:
    lines = [f"before: `{before}`  ", f"after: `{after}`", "",
             "| benchmark | scope | questions | before | after | change (95% interval) | |",
             "|---|---|---|---|---|---|---|"]
    marks = {"regression": "**regression**", "improvement": "improvement", "within noise": "within noise"}
    for r in rows:
        lines.append(f"| {r.benchmark} | {r.scope} | {r.questions} | {r.before:.3f} | {r.after:.3f} | "
                     f"{r.difference:+.3f} ({r.low:+.3f} to {r.high:+.3f}) | {marks[r.verdict]} |")
    return "\n".join(lines) + "\n"


def _in(field: str, value) -> Callable[[dict], bool]:
    """Whether a unit's ``field`` is ``value`` (a category's scope)."""
    return lambda unit: unit[field] == value
