"""Reading a model's answer as each benchmark's reference harness reads it.

- :func:`can_infer`: VLMEvalKit's multiple-choice extraction (``vlmeval/utils/matching_util.py``) with its
  default exact-matching judge: a choice letter standing alone once among the reply's last four words, else the
  one option whose text the (not overlong) reply contains, else no answer.
- :func:`parse_multi_choice_response` and :func:`parse_open_response`: the MMMU repository's
  ``eval/eval_utils.py``, which lmms-eval copies. lmms-eval's copy also accepts a letter glued to what precedes
  it (``"{letter} "``, so ``"ELISA test"`` names A) and a letter followed by a full stop; the MMMU repository's
  rule (a letter standing alone between spaces) is followed here, because it is the benchmark's own and a word
  ending in a capital letter is no answer. Where MMMU draws a random letter for a reply that names none, the
  draw here is seeded by the item's id, so a score is the same on every run.
"""

from __future__ import annotations

import random
import re
import zlib

OPTION_STRIP = ".()[],:;!*#{}"  # replaced by spaces before the reply is split into words (can_infer_option)
REFUSALS = ("Sorry, I can't help with images of people yet.", "I can't process this file.",
            "I'm sorry, but without the image provided", "Cannot determine the answer")
NO_ANSWER = "Z"  # VLMEvalKit's mark for a reply that names no option


def can_infer_option(reply: str, options: dict[str, str]) -> str | None:
    """The letter of ``options`` that ``reply`` names as a word among its last four words, when it names
    exactly one; ``"Z"`` for a refusal (or a lone ``Z``); None when undecided."""
    if any(refusal in reply for refusal in REFUSALS):
        return NO_ANSWER
    for char in OPTION_STRIP:
        reply = reply.replace(char, " ")
    words = reply.split()
    named = [letter for letter in options if letter in words]
    if len(named) == 1:
        letter = named[0]
        return letter if words.index(letter) > len(words) - 5 else None
    if not named and "Z" in words:
        return NO_ANSWER
    return None


def can_infer_text(reply: str, options: dict[str, str]) -> str | None:
    """The one option whose text (lower-cased) is in the lower-cased reply, unless the reply is over twice as
    long as the options' texts together."""
    reply = reply.lower()
    if len(reply) > 2 * sum(len(str(text)) for text in options.values()):
        return None
    found = [letter for letter, text in options.items() if str(text).lower() in reply]
    return found[0] if len(found) == 1 else None


def can_infer(reply: str, options: dict[str, str]) -> str | None:
    """VLMEvalKit's letter for ``reply`` (a letter of ``options``, ``"Z"`` or None: wrong either way)."""
    return can_infer_option(reply, options) or can_infer_text(reply, options)


def parse_multi_choice_response(reply: str, options: dict[str, str], item_id: str) -> str:
    """MMMU's letter for ``reply``: ``(X)``, else a letter between spaces, else (replies of more than five words)
    an option's text; the last one in the reply when several; a seeded draw when none."""
    for char in ",.!?;:'":
        reply = reply.strip(char)
    reply = f" {reply} "
    letters = list(options)
    found = [letter for letter in letters if f"({letter})" in reply]
    where = [reply.rfind(f"({letter})") for letter in found]
    if not found:
        found = [letter for letter in letters if f" {letter} " in reply]
        where = [reply.rfind(f" {letter} ") for letter in found]
    if not found and len(reply.split()) > 5:
        found = [letter for letter in letters if options[letter].lower() in reply.lower()]
        where = [reply.lower().rfind(options[letter].lower()) for letter in found]
    if not found:
        return random.Random(zlib.crc32(item_id.encode())).choice(letters)
    return found[max(range(len(found)), key=where.__getitem__)]  # the first of equals, as numpy's argmax


_NUMBER_WITH_COMMAS = re.compile(r"-?\b\d{1,3}(?:,\d{3})+\b")
_NUMBER_SCIENTIFIC = re.compile(r"-?\d+(?:\.\d+)?[eE][+-]?\d+")
_NUMBER_SIMPLE = re.compile(r"-?(?:\d+\.\d+|\.\d+|\d+\b)(?![eE][+-]?\d+)(?![,\d])")
_KEY_PHRASES = ("could be ", "so ", "is ", "thus ", "therefore ", "final ", "answer ", "result ")
_TRIVIAL = {":", ",", ".", "!", "?", ";", "'"}


def extract_numbers(text: str) -> list[str]:
    """Numbers written with thousands commas, in scientific notation, and plain, in that order."""
    return (_NUMBER_WITH_COMMAS.findall(text) + _NUMBER_SCIENTIFIC.findall(text)
            + _NUMBER_SIMPLE.findall(text))


def normalize_answer(text: str) -> list[str | float]:
    """A number as a float rounded to 2 places; text lower-cased, a single character padded on either side."""
    text = text.strip()
    try:
        return [round(float(text.replace(",", "")), 2)]
    except ValueError:
        text = text.lower()
        return [" " + text, text + " "] if len(text) == 1 else [text]


def _key_subresponses(reply: str) -> list[str]:
    reply = reply.strip().strip(".").lower()
    sentences = re.split(r"\.\s(?=[A-Z])|\n", reply)
    keys = []
    for index, sentence in enumerate(sentences):
        phrases = _KEY_PHRASES + (("=",) if index == len(sentences) - 1 else ())
        shortest = ""  # MMMU's loop: an empty tail is replaced by the next phrase's, a shorter one replaces it
        for phrase in phrases:
            if phrase in sentence:
                tail = sentence.split(phrase)[-1].strip()
                if not shortest or len(tail) < len(shortest):
                    shortest = tail
        if shortest and shortest.strip() not in _TRIVIAL:
            keys.append(shortest)
    return keys or [reply]


def parse_open_response(reply: str) -> list[str | float]:
    """MMMU's candidate answers in an open reply: the tail after each sentence's last key phrase (``is``,
    ``so``, ``therefore``, ... and ``=`` in the last sentence), and every number in them, normalised."""
    keys = _key_subresponses(reply)
    candidates = keys + [number for key in keys for number in extract_numbers(key)]
    normalized = [value for candidate in candidates for value in normalize_answer(candidate)]
    return list(dict.fromkeys(normalized))


def eval_open(golds: list[str], predictions: list[str | float]) -> bool:
    """MMMU's open-question judgement: a normalised gold text inside a predicted text, or a gold number among
    the predicted numbers."""
    normalized = [value for gold in golds for value in normalize_answer(gold)]
    for prediction in predictions:
        if isinstance(prediction, str):
            if any(isinstance(gold, str) and gold in prediction for gold in normalized):
                return True
        elif prediction in normalized:
            return True
    return False
