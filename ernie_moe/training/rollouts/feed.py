"""The GRPO stage's feed (a ``data.feeding.feed.Feed``): a rollout of sampled, scored answers, one mini-batch of it
each optimizer step it serves."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from contextlib import nullcontext

import paddle

from ... import host_reads
from ...config.schema import Config
from ...data import DataError
from ...data.encoding.packing import BadSample, Row
from ...data.encoding.tokenizer import Tokenizer
from ...data.feeding.loader import training_encoder
from ...objectives.policy import group_advantages
from ...objectives.rewards import Reward
from ...parallel.env import DistEnv
from ...parallel.zero import stage_of
from .figures import RolloutFigures
from .old_policy import old_policy
from .prompts import Prompt, PromptOrder, asked
from .rows import group_rows
from .sampling import Group, Sampler

MAX_ROUNDS = 8  # rounds of prompts one rollout may take before it gives up on filling its groups


class RolloutFeed:
    def __init__(self, dataset, runner, tokenizer: Tokenizer, cfg: Config, env: DistEnv, precision,
                 rewards: Sequence[Reward], stats: Counter):
        t = cfg.training
        self.dataset, self.runner, self.tokenizer, self.cfg, self.env = dataset, runner, tokenizer, cfg, env
        self.stats = stats
        self.encoder = training_encoder(tokenizer, cfg, Counter())
        self.group_size, self.length = t.rl.group_size, cfg.data.max_seq_len
        model = runner.model
        # expert-parallel ranks exchange their tokens in every MoE forward, and at sharding stage 3 the data ranks
        # gather each layer's weights: they decode in step, and sample every round, full or not
        self.exchange = env.data_group if stage_of(env) == 3 else env.expert_group \
            if env.expert_group is not None and not model.plan.experts_on_tp_ranks else None
        self.order = PromptOrder(len(dataset), t.seed, env.data_rank, env.data_world)
        self.sample = Sampler(model, tokenizer, cfg, precision, rewards, self.lockstep)
        self.figures = RolloutFigures(rewards, tokenizer, env)
        self.pending: list[Row] = []  # this rank's rows of the rollout being trained on

    # ---------------------------------------------------------------- the feed
    def next_step(self, micro_batch_size: int, accumulation_steps: int) -> list[list[Row]]:
        """This rank's rows of each micro-batch of the next step: the next mini-batch of the rollout, after a new
        rollout where the last one is used up."""
        need = micro_batch_size * accumulation_steps
        if len(self.pending) < need:
            self.pending = self._rollout(need, self.cfg.training.rl.updates_per_rollout)
            if self.cfg.training.router_replay == "old_policy":
                started = time.perf_counter()
                old_policy(self.pending, self.runner, self.length, micro_batch_size, accumulation_steps)
                self.figures.window["seconds"] += time.perf_counter() - started
        rows, self.pending = self.pending[:need], self.pending[need:]
        return [rows[i * micro_batch_size:(i + 1) * micro_batch_size] for i in range(accumulation_steps)]

    def gate(self) -> None:
        """Rollouts are sampled in the step; there is no reader to hold back."""

    def reading(self):
        return nullcontext()

    def state_dict(self) -> dict:
        return {"prompts_read": self.order.prompts_read}

    def load_state_dict(self, state: dict) -> None:
        taken = state.get("prompts_read") if isinstance(state, dict) else None
        if not isinstance(taken, int) or isinstance(taken, bool) or taken < 0:
            raise DataError(f"the saved rollout position 'prompts_read' must be a whole number of 0 or more, not "
                            f"{taken!r} (a checkpoint of another training.stage?)")
        self.order.prompts_read, self.pending = taken, []

    def close(self) -> None:
        """Nothing runs in the background."""

    def window_answers(self) -> list[dict]:
        return self.figures.answers()

    def window_metrics(self, elapsed: float) -> dict:
        return self.figures.metrics(elapsed)

    # ---------------------------------------------------------------- a rollout
    def _rollout(self, step_rows: int, updates: int = 1) -> list[Row]:
        """This rank's rows of a new rollout: ``step_rows`` for each of ``updates`` optimizer steps, in order. Each
        step's global rows are one round of prompts, of which every data rank has its contiguous share, so a step
        trains on the same rows in every layout; the rounds are sampled together."""
        started = time.perf_counter()
        per_step = step_rows // self.group_size
        want = per_step * updates
        dynamic = self.cfg.training.rl.dynamic_sampling
        window = self.figures.window
        kept: list[Group] = []
        spare: list[Group] = []  # groups dynamic sampling dropped: the filling of last resort
        # every rank takes every round, full or not: the position stays the same everywhere
        slots = [slot for _ in range(updates) for slot in self.order.round(per_step)]
        for _ in range(MAX_ROUNDS):
            sampled = self._sample(self._prompts(slots)) if len(kept) < want or self.exchange else []
            for group in sampled if len(kept) < want else []:
                window["groups"] += 1
                window["equal_groups"] += group.equal
                (spare if dynamic and group.equal else kept).append(group)
            if not self._anyone_missing(want - len(kept)):
                break
            slots = list(self.order.round(per_step))
        if len(kept) < want:  # rounds ran out: groups without advantage fill the rest
            window["equal_groups_kept"] += min(want - len(kept), len(spare))
            kept += spare[: want - len(kept)]
        if len(kept) < want:
            raise DataError(f"a rollout found {len(kept)} usable prompt(s) of the {want} it needs in {MAX_ROUNDS} "
                            "rounds; see the data/skipped_rollout_* counts and data.max_seq_len against "
                            "training.rl.max_new_tokens")
        window["seconds"] += time.perf_counter() - started
        return [row for group in kept[:want] for row in self._rows(group)]

    def _prompts(self, slots: list[int]) -> list[Prompt]:
        """The usable prompts at ``slots``; the others counted."""
        prompts = []
        for slot in slots:
            try:
                prompt = asked(self.dataset[self.order.index(slot)], self.encoder, self.tokenizer, slot)
            except BadSample as bad:
                self.stats[f"rollout_{bad.reason}"] += 1
                continue
            if len(prompt.encoded) + self.cfg.training.rl.max_new_tokens + 1 > self.length:
                self.stats["rollout_prompt_too_long"] += 1
                continue
            prompts.append(prompt)
        return prompts

    def _sample(self, prompts: list[Prompt]) -> list[Group]:
        if not prompts:
            if self.exchange is not None:
                raise DataError("a round of prompts left this data rank none to sample, and with expert "
                                "parallelism or sharding stage 3 every rank of the group decodes in step; see the "
                                "data/skipped_rollout_* counts")
            return []
        return self.sample(prompts)

    def _rows(self, group: Group) -> list[Row]:
        """The group's answers as training rows, with their advantages; its figures into the window."""
        advantages = group_advantages(group.rewards, self.group_size, self.cfg.training.rl.loss != "dr_grpo")
        self.figures.add(group, advantages)
        return group_rows(group, advantages, self.tokenizer, self.length)

    def lockstep(self, finished: bool) -> bool:
        """Whether a rank of this one's expert-parallel group has not finished decoding (generate_batch)."""
        return self._on_any_rank(not finished, self.exchange, "decoding")

    def _anyone_missing(self, missing: int) -> bool:
        """Whether some data rank still misses groups (every rank takes the next round together)."""
        return self._on_any_rank(missing > 0, self.env.data_group, "rollout")

    def _on_any_rank(self, flag: bool, group, reason: str) -> bool:
        """Whether ``flag`` holds on any rank of ``group`` (all of them ask together; None: this rank alone)."""
        if group is None or group.nranks == 1:
            return flag
        count = self.env.all_reduce_sum(paddle.to_tensor([int(flag)], dtype="int64"), group)
        return bool(host_reads.read(count, reason))
