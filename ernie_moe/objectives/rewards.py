"""Rewards a program can check: each scores a generated answer against the sample's reference answer.

``training.rewards`` names them, ``training.reward_weights`` weighs them (1 each by default); the evaluation by
generation logs each one's mean and their weighted sum. Built-ins:

- ``exact_match``: 1 when the answer's text equals the reference's (whitespace normalised);
- ``containment``: 1 when the reference's text appears in the answer's;
- ``word_accuracy``: the share of the reference's words the answer has at the same place (a caption's words
  right);
- ``numeric``: 1 when the answer's last number equals the reference's last number (relative 1e-6; thousands
  separators ignored);
- ``regex``: 1 when ``training.reward_pattern`` matches somewhere in the answer;
- ``think_format``: 1 when the answer is the Thinking template's ``<think>...</think>`` followed by an answer.

Anything else must be ``module:function``: your Python function ``(answer, reference) -> float``, imported from
your own module when the run starts. It runs your code; rewards are only ever named in the config, never in data.
"""

from __future__ import annotations

import importlib
import math
import numbers
import re
from collections.abc import Callable
from dataclasses import dataclass

from ..config.errors import ConfigError
from ..config.schema import TrainingConfig

_NUMBER = re.compile(r"[-+]?(?:\d[\d,]*\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")
_THINK = re.compile(r"\s*<think>.*?</think>\s*\S.*", re.DOTALL)
_FUNCTION = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*")


def normalised(text: str) -> str:
    return " ".join(text.split())


def exact_match(answer: str, reference: str) -> float:
    return float(normalised(answer) == normalised(reference))


def containment(answer: str, reference: str) -> float:
    return float(normalised(reference) in normalised(answer))


def word_accuracy(answer: str, reference: str) -> float:
    expected, got = reference.split(), answer.split()
    if not expected:
        return float(not got)
    return sum(a == b for a, b in zip(got, expected)) / len(expected)


def last_number(text: str) -> float | None:
    found = _NUMBER.findall(text)
    if not found:
        return None
    try:
        return float(found[-1].replace(",", ""))
    except ValueError:  # a lone sign or separator
        return None


def numeric(answer: str, reference: str) -> float:
    got, expected = last_number(answer), last_number(reference)
    if got is None or expected is None:
        return 0.0
    return float(math.isclose(got, expected, rel_tol=1e-6, abs_tol=1e-12))


def think_format(answer: str, reference: str) -> float:
    return float(_THINK.fullmatch(answer) is not None)


BUILT_IN: dict[str, Callable[[str, str], float]] = {
    "exact_match": exact_match, "containment": containment, "word_accuracy": word_accuracy, "numeric": numeric,
    "think_format": think_format}


@dataclass(frozen=True)
class Reward:
    name: str  # the figure's name: eval_generate_reward_<name>
    weight: float
    function: Callable[[str, str], float]
    source: str  # as the config names it

    def __call__(self, answer: str, reference: str) -> float:
        try:
            value = self.function(answer, reference)
        except Exception as err:  # the user's own code: say whose it is
            raise ConfigError(f"the reward {self.source} failed on an answer: {type(err).__name__}: {err}") from err
        # any real number (NumPy's too), finite; not a truth value
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
            raise ConfigError(f"the reward {self.source} returned {value!r} ({type(value).__name__}); a reward is a "
                              "finite number")
        return float(value)


def build_rewards(training_cfg: TrainingConfig) -> list[Reward]:
    """The rewards ``training.rewards`` names, weighed; ConfigError naming what cannot be one."""
    t = training_cfg
    weights = t.reward_weights or [1.0] * len(t.rewards)
    rewards = []
    for spec, weight in zip(t.rewards, weights):
        if spec == "regex":
            rewards.append(Reward("regex", weight, _found(re.compile(t.reward_pattern)), spec))
        elif spec in BUILT_IN:
            rewards.append(Reward(spec, weight, BUILT_IN[spec], spec))
        else:
            rewards.append(Reward(spec.rpartition(":")[2], weight, _user_function(spec), spec))
    names = [r.name for r in rewards]
    if len(set(names)) != len(names):
        raise ConfigError(f"training.rewards {t.rewards} names a reward twice (figures are named by {names})")
    return rewards


def _found(pattern: re.Pattern) -> Callable[[str, str], float]:
    """The ``regex`` reward: 1 when ``pattern`` is found in the answer."""
    return lambda answer, reference: float(pattern.search(answer) is not None)


def _user_function(spec: str) -> Callable[[str, str], float]:
    if not _FUNCTION.fullmatch(spec):
        raise ConfigError(f"training.rewards: '{spec}' is neither a built-in ({', '.join([*BUILT_IN, 'regex'])}) "
                          "nor module:function")
    module, _, name = spec.partition(":")
    try:
        loaded = importlib.import_module(module)
    except ImportError as err:
        raise ConfigError(f"training.rewards: cannot load {spec}: {err} (the module is imported from the folder of "
                          "the script the run starts, or from PYTHONPATH: put its folder there)") from None
    except Exception as err:  # the user's module itself: a syntax error, or raising while it is imported
        where = f" ({err.filename} line {err.lineno})" if isinstance(err, SyntaxError) else ""
        raise ConfigError(f"training.rewards: cannot load {spec}: importing {module} raised "
                          f"{type(err).__name__}: {err}{where}") from None
    function = getattr(loaded, name, None)
    if function is None:
        raise ConfigError(f"training.rewards: cannot load {spec}: module {module} has no {name}")
    if not callable(function):
        raise ConfigError(f"training.rewards: {spec} is not a function")
    return function
