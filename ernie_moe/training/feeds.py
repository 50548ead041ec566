"""The run's feed (``data.feeding.feed.Feed``), chosen in one place by what the objective trains on: the policy's
rollouts in the GRPO stage, preference pairs in the DPO stage, packed rows otherwise."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from ..config import Config
from ..data.encoding.tokenizer import Tokenizer
from ..data.feeding.feed import Feed, RowFeed
from ..objectives.rewards import Reward
from ..parallel.env import DistEnv
from .rollouts import RolloutFeed


def build_feed(cfg: Config, train_set, tokenizer: Tokenizer, env: DistEnv, stats: Counter, runner, precision,
               rewards: Sequence[Reward]) -> Feed:
    """``stats``: where the feed counts skipped and fitted samples; ``runner``, ``precision`` and ``rewards``:
    what a rollout samples and scores with."""
    kind = runner.objective.trains_on
    if kind == "rollouts":
        return RolloutFeed(train_set, runner, tokenizer, cfg, env, precision, rewards, stats)
    # packed rows, or preference pairs (a row each)
    return RowFeed(train_set, tokenizer, cfg, env, stats, runner.objective.row_inputs)
