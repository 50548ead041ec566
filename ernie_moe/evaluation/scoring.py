"""Prompts, answer extraction and scores per benchmark kind, and a benchmark's figures from its items' scores.

Each kind asks as its reference harness asks (VLMEvalKit's ``build_prompt`` for the multiple-choice TSVs and the
VQA sets, lmms-eval's MMMU prompt) and reads the reply as it reads it (:mod:`.answers`, :mod:`.metrics`). The
figures: the mean item score (for ``mmbench``, of questions all of whose rotations are right), and the same per
category and per l2-category. MMStar's lmms-eval score is the mean of its l2-categories' accuracies; the mean over
questions is VLMEvalKit's, and the one here (the per-l2-category figures give the other).
"""

from __future__ import annotations

from collections import defaultdict

from .answers import can_infer, eval_open, parse_multi_choice_response, parse_open_response
from .formats import Item
from .metrics import anls, ocrbench_hit, relaxed_accuracy

MCQ_ASK = "Please select the correct answer from the options above. \n"  # VLMEvalKit, trailing space and all
MMMU_CHOICE_ASK = "Answer with the option's letter from the given choices directly."
SHORT_ASK = "Answer the question using a single word or phrase."

RULES = {
    "mcq": "VLMEvalKit ImageMCQDataset prompt; can_infer (exact matching, before its June 2026 change); accuracy",
    "mmbench": "VLMEvalKit ImageMCQDataset prompt; can_infer (exact matching, before its June 2026 change); "
               "CircularEval accuracy",
    "mmmu": "lmms-eval MMMU prompt; MMMU parse_multi_choice_response / parse_open_response + eval_open; "
            "accuracy over questions",
    "chartqa": "VLMEvalKit VQA prompt; relaxed accuracy at 5% (pix2struct), prediction stripped",
    "docvqa": "VLMEvalKit VQA prompt; ANLS at 0.5 over normalised lengths",
    "infovqa": "VLMEvalKit VQA prompt; ANLS at 0.5 over normalised lengths",
    "ocrbench": "question as given; OCRBench containment (HMER without spaces); correct items over items",
    "text_mcq": "question, lettered options, lmms-eval's letter request; can_infer (exact matching); accuracy",
}
DEFAULT_MAX_NEW_TOKENS = {"chartqa": 16, "docvqa": 32, "infovqa": 32, "ocrbench": 64, "mmmu": 32}
MCQ_MAX_NEW_TOKENS = 16


def max_new_tokens(kind: str) -> int:
    """The answer length the kind's harness asks for by default (short answers, letters)."""
    return DEFAULT_MAX_NEW_TOKENS.get(kind, MCQ_MAX_NEW_TOKENS)


def prompt_text(kind: str, item: Item) -> str:
    """The user turn's text; images go before it (``<image>`` markers first), MMMU's at its ``<image N>``
    markers (:func:`user_content`)."""
    if kind in ("mcq", "mmbench"):
        text = f"Hint: {item.hint}\n" if item.hint else ""
        text += f"Question: {item.question}\n"
        text += "Options:\n" + "".join(f"{letter}. {option}\n" for letter, option in item.options.items())
        return text + MCQ_ASK
    if kind == "mmmu":  # lmms-eval's construct_prompt
        if item.open:
            return f"{item.question}\n\n{SHORT_ASK}"
        options = "\n".join(f"{letter}. {option}" for letter, option in item.options.items())
        return f"{item.question}\n{options}\n\n{MMMU_CHOICE_ASK}"
    if kind == "text_mcq":
        options = "".join(f"{letter}. {option}\n" for letter, option in item.options.items())
        return f"{item.question}\n{options}{MMMU_CHOICE_ASK}"
    if kind == "ocrbench":
        return item.question
    return f"{item.question}\n{SHORT_ASK}"


def user_content(kind: str, item: Item) -> str:
    """The user turn with ``<image>`` markers where its images go, in the order of ``item.images``."""
    text = prompt_text(kind, item)
    if kind == "mmmu":  # each image once, where its marker first stands (in the question or an option)
        for number in item.markers:
            text = text.replace(f"<image {number}>", "<image>", 1)
        return text
    return "<image>" * len(item.images) + text


def judge(kind: str, item: Item, reply: str) -> tuple[str, float]:
    """(what the harness reads out of ``reply``, the item's score)."""
    if kind in ("mcq", "mmbench", "text_mcq"):
        letter = can_infer(reply, item.options) or ""
        return letter, float(letter == item.answers[0])
    if kind == "mmmu":
        if item.open:
            parsed = parse_open_response(reply)
            return " | ".join(str(p) for p in parsed), float(eval_open(list(item.answers), parsed))
        letter = parse_multi_choice_response(reply, item.options, item.id)
        return letter, float(letter == item.answers[0])
    if kind == "chartqa":
        return reply.strip(), relaxed_accuracy(list(item.answers), reply)
    if kind in ("docvqa", "infovqa"):
        return reply.strip(), anls(list(item.answers), reply)
    if kind == "ocrbench":
        return reply.strip(), ocrbench_hit(list(item.answers), reply, item.category)
    raise ValueError(f"unknown benchmark kind {kind!r}")


def unit_of(kind: str, item: Item) -> str:
    """What a score is counted for: the question (with CircularEval, all of its rotations together)."""
    return item.group if kind == "mmbench" else item.id


def figures(kind: str, items: list[Item], scores: dict[int, float]) -> dict:
    """``score`` (and ``count``) over the scored items (``scores``: item position -> score), then
    ``category/<name>`` and ``l2_category/<name>``; with CircularEval a question's rotations count once, right
    only when all are."""
    return unit_figures(units([{"unit": unit_of(kind, items[i]), "category": items[i].category,
                                "l2_category": items[i].l2_category, "score": score} for i, score in scores.items()]))


def units(records: list[dict]) -> dict[str, dict]:
    """Each unit's score (the lowest of its records': all rotations right, or not) and categories, from records
    with ``unit``, ``category``, ``l2_category`` and ``score``."""
    out: dict[str, dict] = {}
    for record in records:
        unit = out.setdefault(record["unit"], {"category": record.get("category", ""),
                                               "l2_category": record.get("l2_category", ""), "score": 1.0})
        unit["score"] = min(unit["score"], float(record["score"]))
    return out


def unit_figures(scored: dict[str, dict]) -> dict:
    """The mean unit score and its count, then per category and per l2-category."""
    if not scored:
        return {}
    result = {"score": sum(u["score"] for u in scored.values()) / len(scored), "count": len(scored)}
    for field in ("category", "l2_category"):
        grouped: dict[str, list[float]] = defaultdict(list)
        for unit in scored.values():
            if unit[field]:
                grouped[unit[field]].append(unit["score"])
        for name in sorted(grouped):
            result[f"{field}/{name}"] = sum(grouped[name]) / len(grouped[name])
    return result
