"""Each benchmark's per-item score, as its reference harness computes it.

- :func:`relaxed_correctness`: ChartQA's relaxed accuracy (pix2struct): numbers within 5% of a non-zero gold,
  anything else equal ignoring case. VLMEvalKit strips the prediction first; lmms-eval does not, so there
  ``"Yes\\n"`` is wrong against ``"yes"``. Stripped here (VLMEvalKit's rule): the spacing around an answer is the
  decoder's, not the model's knowledge.
- :func:`anls`: DocVQA / InfoVQA's average normalised Levenshtein similarity at threshold 0.5. The distance is
  divided by the longer normalised string, as ANLS is defined; VLMEvalKit's ``anls_compute`` and lmms-eval both
  divide by the raw strings' lengths, which scores a reply with trailing whitespace higher (gold ``abd``:
  ``"abc  \n"`` 0.833 there, 0.667 here, as ``"abc"`` scores everywhere).
- :func:`ocrbench_hit`: OCRBench's containment: a gold answer inside the prediction, both lower-cased and
  stripped with newlines as spaces, or, for handwritten mathematical expressions, both without spaces and
  newlines, case kept. Scored per item (lmms-eval divides by 1000 whatever the set's size).
"""

from __future__ import annotations

HME_CATEGORY = "Handwritten Mathematical Expression Recognition"
ANLS_THRESHOLD = 0.5
RELAXED_TOLERANCE = 0.05


def _to_float(text: str) -> float | None:
    try:
        return float(text.rstrip("%")) / 100.0 if text.endswith("%") else float(text)
    except ValueError:
        return None


def relaxed_correctness(gold: str, prediction: str, tolerance: float = RELAXED_TOLERANCE) -> bool:
    """pix2struct's relaxed correctness of one prediction against one gold answer."""
    prediction_value, gold_value = _to_float(prediction), _to_float(gold)
    if prediction_value is not None and gold_value:
        return abs(prediction_value - gold_value) / abs(gold_value) <= tolerance
    return prediction.lower() == gold.lower()


def relaxed_accuracy(golds: list[str], prediction: str) -> float:
    """ChartQA's item score: 1 when the stripped prediction is relaxed-correct against any gold answer."""
    prediction = prediction.strip()
    return float(any(relaxed_correctness(gold.strip(), prediction) for gold in golds))


def levenshtein(a: str, b: str) -> int:
    """Edit distance (insertions, deletions, substitutions of one character each)."""
    if len(a) < len(b):
        a, b = b, a
    previous = list(range(len(b) + 1))
    for i, char_a in enumerate(a, start=1):
        current = [i]
        for j, char_b in enumerate(b, start=1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (char_a != char_b)))
        previous = current
    return previous[-1]


def _normalize(text: str) -> str:
    return " ".join(text.strip().lower().split())


def anls(golds: list[str], prediction: str, threshold: float = ANLS_THRESHOLD) -> float:
    """The item's ANLS: 1 - the smallest normalised edit distance to a gold answer, 0 below ``threshold``
    (a similarity of exactly the threshold counts, as both harnesses score it)."""
    prediction = _normalize(prediction)
    best = 0.0
    for gold in golds:
        gold = _normalize(gold)
        longest = max(len(gold), len(prediction))
        similarity = 1.0 - (levenshtein(gold, prediction) / longest if longest else 0.0)
        best = max(best, similarity)
    return best if best >= threshold else 0.0


def ocrbench_hit(golds: list[str], prediction: str, category: str = "") -> float:
    """OCRBench's item score (1 or 0)."""
    if category == HME_CATEGORY:
        def squeeze(text: str) -> str:
            return text.strip().replace("\n", "").replace(" ", "")
    else:
        def squeeze(text: str) -> str:
            return text.lower().strip().replace("\n", " ")
    prediction = squeeze(prediction)
    return float(any(squeeze(gold) in prediction for gold in golds))
