"""Answers sampled to prompts: ``rl.group_size`` to each, all of a rank's side by side with the package's KV-cache
decoding, each with its own seed (drawn from the run's seed and the prompt's place in the shuffle, so a layout does
not change what is sampled), scored by the rewards; with router replay the experts each token went to."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass

import numpy as np
import paddle

from ...config.schema import Config
from ...data.encoding.tokenizer import Tokenizer
from ...generation import Decoding, generate_batch
from ...generation.decoding import Generated
from ...moe.replay import moe_layer_ids, recording, rows_of_generation
from ...objectives.rewards import Reward
from ...parallel.pipeline import TrainedModel
from .prompts import Prompt


@dataclass
class Group:
    prompt: Prompt
    answers: list[Generated]
    scores: np.ndarray  # [answers, rewards]
    rewards: np.ndarray  # [answers] weighted sum
    routes: list[np.ndarray | None]  # each answer's [moe layers, seq, k], or None without replay

    @property
    def equal(self) -> bool:
        return bool(np.all(self.rewards == self.rewards[0]))


class Sampler:
    """The policy's answers to a rank's prompts, scored. ``lockstep(finished)``: whether a rank that decodes in
    step with this one (expert parallelism, sharding stage 3) has not finished (``generation.generate_batch``)."""

    def __init__(self, model: TrainedModel, tokenizer: Tokenizer, cfg: Config, precision, rewards: Sequence[Reward],
                 lockstep: Callable[[bool], bool] | None):
        self.model, self.tokenizer, self.precision, self.rewards = model, tokenizer, precision, list(rewards)
        self.settings, self.seed, self.length = cfg.training.rl, cfg.training.seed, cfg.data.max_seq_len
        self.lockstep = lockstep
        self.replay = cfg.training.router_replay == "rollout" and bool(model.moe_layers())  # routes while sampling

    @paddle.no_grad()
    def __call__(self, prompts: list[Prompt]) -> list[Group]:
        g = self.settings.group_size
        encoded = [p.encoded for p in prompts for _ in range(g)]
        decodings = [Decoding(self.settings.max_new_tokens, self.settings.temperature, self.settings.top_p,
                              seed=(self.seed * 1_000_003 + p.slot) * g + i) for p in prompts for i in range(g)]
        was_training = self.model.training
        self.model.eval()
        try:
            with recording(self.model) if self.replay else nullcontext() as records, self.precision.autocast():
                answers = generate_batch(self.model, encoded, decodings, self.tokenizer.eos_id,
                                         never=(self.model.cfg.im_patch_id,), tokens=self.tokenizer.vocab_size,
                                         with_logps=True, lockstep=self.lockstep)
        finally:
            self.model.train(was_training)
        routes: list[np.ndarray | None] = [None] * len(answers)
        if self.replay and records is not None:  # recorded when replaying
            padding = max(len(e) for e in encoded) - np.array([len(e) for e in encoded])
            table = rows_of_generation(records, moe_layer_ids(self.model.cfg), len(encoded), padding,
                                       [len(a.ids) for a in answers], self.length)
            routes = list(table)
        weights = np.array([r.weight for r in self.rewards])
        groups = []
        for i, prompt in enumerate(prompts):
            mine = answers[i * g:(i + 1) * g]
            texts = [self.tokenizer.decode(a.ids) for a in mine]
            scores = np.array([[reward(text, prompt.reference) for reward in self.rewards] for text in texts])
            groups.append(Group(prompt, mine, scores.reshape(g, len(self.rewards)), scores @ weights,
                                routes[i * g:(i + 1) * g]))
        return groups
