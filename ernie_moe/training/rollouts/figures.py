"""What the rollouts of a logging window did, over every data rank (``rollout/...``), and a few of its groups to
show."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import numpy as np
import paddle

from ... import host_reads
from ...data.encoding.tokenizer import Tokenizer
from ...data.feeding.report import render
from ...objectives.rewards import Reward
from ...parallel.env import DistEnv
from .rows import answer_tokens
from .sampling import Group

ANSWERS_SHOWN = 2  # groups of a window each rank keeps to show (rank 0 writes its own)


class RolloutFigures:
    def __init__(self, rewards: Sequence[Reward], tokenizer: Tokenizer, env: DistEnv):
        self.rewards, self.tokenizer, self.env = list(rewards), tokenizer, env
        self.window: defaultdict[str, float] = defaultdict(float)  # the rollouts' sums since the last window
        self.shown: list[dict] = []  # a few of the window's groups, to show

    def add(self, group: Group, advantages: np.ndarray) -> None:
        """A group trained on: its answers' lengths, entropy and rewards into the window's sums."""
        w = self.window
        if len(self.shown) < ANSWERS_SHOWN:
            self.shown.append({
                "prompt": render(group.prompt.encoded, self.tokenizer), "reference": group.prompt.reference,
                "answers": [{"text": self.tokenizer.decode(a.ids), "reward": float(total), "advantage": float(adv),
                             "scores": {r.name: float(s) for r, s in zip(self.rewards, scores)}}
                            for a, adv, scores, total in zip(group.answers, advantages, group.scores, group.rewards)]})
        for answer, scores, total in zip(group.answers, group.scores, group.rewards):
            w["answers"] += 1
            w["answer_tokens"] += len(answer_tokens(answer, self.tokenizer))
            w["entropy"] += sum(answer.entropies or [])
            w["reward"] += total
            w["reward_sq"] += total * total
            for reward, score in zip(self.rewards, scores):
                w[f"reward_{reward.name}"] += score
                w[f"reward_{reward.name}_sq"] += score * score

    def answers(self) -> list[dict]:
        """This rank's first groups of the window (:data:`ANSWERS_SHOWN`): the prompt as its tokens read, the
        reference, and each answer's text, reward, each reward's score and advantage."""
        answers, self.shown = self.shown, []
        return answers

    def metrics(self, elapsed: float) -> dict:
        """The rollouts' figures since the last call over every data rank: rewards' means and spreads, the share of
        groups whose answers all scored the same, answer lengths, the sampling policy's entropy per answer token,
        sampling speed (tokens per second of a rank) and share of the steps' time (``elapsed`` seconds)."""
        names = ["answers", "answer_tokens", "entropy", "groups", "equal_groups", "seconds", "reward", "reward_sq",
                 "equal_groups_kept", *(f"reward_{r.name}{end}" for r in self.rewards for end in ("", "_sq"))]
        sums = paddle.to_tensor([float(self.window[n]) for n in names], dtype="float64")
        self.window = defaultdict(float)
        sums = self.env.all_reduce_sum(sums, self.env.data_group)  # every data rank's answers
        w = dict(zip(names, host_reads.read(sums, "rollout").tolist()))
        answers = w["answers"]
        if not answers:
            return {}
        out = {}
        for name in ["reward", *(f"reward_{r.name}" for r in self.rewards)]:
            mean = w[name] / answers
            out[f"rollout/{name}"] = mean
            out[f"rollout/{name}_std"] = float(np.sqrt(max(w[f"{name}_sq"] / answers - mean * mean, 0.0)))
        out.update({"rollout/equal_reward_groups": w["equal_groups"] / max(w["groups"], 1),
                    "rollout/equal_groups_kept": w["equal_groups_kept"],
                    "rollout/response_length": w["answer_tokens"] / answers,
                    "rollout/entropy": w["entropy"] / max(w["answer_tokens"], 1.0),
                    "rollout/tokens_per_sec": w["answer_tokens"] / max(w["seconds"], 1e-9),
                    "rollout/time_share": w["seconds"] / self.env.data_world / max(elapsed, 1e-9)})
        return out
