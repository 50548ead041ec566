"""The GRPO stage's feed: prompts from the training data, answers the policy samples to them, scored by the rewards
and turned into training rows.

A rollout takes, for each optimizer step it serves, a round of the next prompts of a seeded shuffle of the training
data (each training sample's last answer is cut off; what precedes it is the prompt, the answer is the reference the
rewards compare with), this data rank its contiguous share of each round, so a step trains on the same rows in
every layout. It samples ``rl.group_size`` answers to each prompt with the package's KV-cache decoding,
all of the rank's answers side by side, each with its own seed (drawn from the run's seed and the prompt's place
in the shuffle, so a layout does not change what is sampled). Each answer becomes a row: the prompt, then the answer
(with its end-of-sentence token where it stopped there) as labels, its group's advantage, the sampling policy's
log-probability of each answer token, and with router replay the experts each token went to. One rollout serves
``rl.updates_per_rollout`` optimizer steps, a mini-batch of its rows each.

A prompt that cannot be used (a sample that cannot be read, an image after its answer, a prompt that leaves no room
for ``rl.max_new_tokens`` in ``data.max_seq_len``) is counted and another round of prompts sampled; so is a group
whose answers all score the same under DAPO's dynamic sampling (it carries no advantage), each rank keeping its
first usable groups; after eight rounds such groups fill what is still missing (``rollout/equal_groups_kept``),
and a rollout with too few usable prompts stops the run with a DataError. Rounds are global: every data rank takes
its share of each, so the position saved in a checkpoint (the prompts taken) is the same everywhere. A resume
starts a new rollout there.
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter, defaultdict
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass

import numpy as np
import paddle

from .. import host_reads
from ..config.schema import Config
from ..data import DataError
from ..data.encoding.packing import BadSample, Encoded, Row, make_row, split_answer
from ..data.encoding.tokenizer import Tokenizer
from ..data.feeding.loader import collate, training_encoder
from ..data.feeding.plan import sample_order
from ..data.feeding.report import render
from ..generation import Decoding, generate_batch
from ..generation.decoding import Generated
from ..moe.replay import moe_layer_ids, recording, routes_of_forward, rows_of_generation
from ..objectives.base import REFERENCE_LOGPS
from ..objectives.policy import ADVANTAGES, OLD_LOGPS, SAMPLER_LOGPS, group_advantages
from ..objectives.rewards import Reward
from ..parallel.env import DistEnv
from ..parallel.zero import stage_of

MAX_ROUNDS = 8  # rounds of prompts one rollout may take before it gives up on filling its groups


@dataclass
class Prompt:
    encoded: Encoded
    reference: str  # the sample's own answer, as text, for the rewards
    slot: int  # its place in the run's shuffle of the prompts


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


ANSWERS_SHOWN = 2  # groups of a window each rank keeps to show (rank 0 writes its own)


class RolloutFeed:
    """The trainer's feed in the GRPO stage (a ``data.feeding.feed.Feed``)."""

    def __init__(self, dataset, runner, tokenizer: Tokenizer, cfg: Config, env: DistEnv, precision,
                 rewards: Sequence[Reward],
                 stats: Counter):
        t = cfg.training
        self.dataset, self.runner, self.tokenizer, self.cfg, self.env = dataset, runner, tokenizer, cfg, env
        self.model = model = runner.model
        self.precision, self.rewards, self.stats = precision, list(rewards), stats
        self.encoder = training_encoder(tokenizer, cfg, Counter())
        self.group_size, self.length = t.rl.group_size, cfg.data.max_seq_len
        self.replay = t.router_replay == "rollout" and bool(model.moe_layers())  # routes recorded while sampling
        # expert-parallel ranks exchange their tokens in every MoE forward, and at sharding stage 3 the data ranks
        # gather each layer's weights: they decode in step, and sample every round, full or not
        self.exchange = env.data_group if stage_of(env) == 3 else env.expert_group \
            if env.expert_group is not None and not model.plan.experts_on_tp_ranks else None
        self.prompts_read = 0  # global prompt slots taken so far
        self._order: tuple[int, np.ndarray] = (-1, np.zeros(0, np.int64))  # (pass over the data, its seeded order)
        self.pending: list[Row] = []  # this rank's rows of the rollout being trained on
        self.window: defaultdict[str, float] = defaultdict(float)  # the rollouts' sums since the last logging window
        self.answers: list[dict] = []  # a few of the window's groups, to show

    # ---------------------------------------------------------------- the feed
    def next_step(self, micro_batch_size: int, accumulation_steps: int) -> list[list[Row]]:
        """This rank's rows of each micro-batch of the next step: the next mini-batch of the rollout, after a new
        rollout where the last one is used up."""
        need = micro_batch_size * accumulation_steps
        if len(self.pending) < need:
            self.pending = self._rollout(need, self.cfg.training.rl.updates_per_rollout)
            if self.cfg.training.router_replay == "old_policy":
                self._old_policy(self.pending, micro_batch_size, accumulation_steps)
        rows, self.pending = self.pending[:need], self.pending[need:]
        return [rows[i * micro_batch_size:(i + 1) * micro_batch_size] for i in range(accumulation_steps)]

    def gate(self) -> None:
        """Rollouts are sampled in the step; there is no reader to hold back."""

    def reading(self):
        return nullcontext()

    def state_dict(self) -> dict:
        return {"prompts_read": self.prompts_read}

    def load_state_dict(self, state: dict) -> None:
        taken = state.get("prompts_read") if isinstance(state, dict) else None
        if not isinstance(taken, int) or isinstance(taken, bool) or taken < 0:
            raise DataError(f"the saved rollout position 'prompts_read' must be a whole number of 0 or more, not "
                            f"{taken!r} (a checkpoint of another training.stage?)")
        self.prompts_read, self.pending = taken, []

    def close(self) -> None:
        """Nothing runs in the background."""

    def window_answers(self) -> list[dict]:
        """This rank's first groups of the window (:data:`ANSWERS_SHOWN`): the prompt as its tokens read, the
        reference, and each answer's text, reward, each reward's score and advantage."""
        answers, self.answers = self.answers, []
        return answers

    def window_metrics(self, elapsed: float) -> dict:
        """The rollouts' figures since the last call (``rollout/...``) over every data rank: rewards' means and
        spreads, the share of groups whose answers all scored the same, answer lengths, the sampling policy's
        entropy per answer token, sampling speed (tokens per second of a rank) and share of the steps' time
        (``elapsed`` seconds)."""
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

    # ---------------------------------------------------------------- a rollout
    def _rollout(self, step_rows: int, updates: int = 1) -> list[Row]:
        """This rank's rows of a new rollout: ``step_rows`` for each of ``updates`` optimizer steps, in order. Each
        step's global rows are one round of prompts, of which every data rank has its contiguous share, so a step
        trains on the same rows in every layout; the rounds are sampled together."""
        started = time.perf_counter()
        per_step = step_rows // self.group_size
        want = per_step * updates
        dynamic = self.cfg.training.rl.dynamic_sampling
        kept: list[Group] = []
        spare: list[Group] = []  # groups dynamic sampling dropped: the filling of last resort
        # every rank takes every round, full or not: the position stays the same everywhere
        slots = [slot for _ in range(updates) for slot in self._round(per_step)]
        for _ in range(MAX_ROUNDS):
            sampled = self._sample(self._prompts(slots)) if len(kept) < want or self.exchange else []
            for group in sampled if len(kept) < want else []:
                self.window["groups"] += 1
                self.window["equal_groups"] += group.equal
                (spare if dynamic and group.equal else kept).append(group)
            if not self._anyone_missing(want - len(kept)):
                break
            slots = list(self._round(per_step))
        if len(kept) < want:  # rounds ran out: groups without advantage fill the rest
            self.window["equal_groups_kept"] += min(want - len(kept), len(spare))
            kept += spare[: want - len(kept)]
        if len(kept) < want:
            raise DataError(f"a rollout found {len(kept)} usable prompt(s) of the {want} it needs in {MAX_ROUNDS} "
                            "rounds; see the data/skipped_rollout_* counts and data.max_seq_len against "
                            "training.rl.max_new_tokens")
        self.window["seconds"] += time.perf_counter() - started
        return [row for group in kept[:want] for row in self._rows(group)]

    def _round(self, groups: int) -> range:
        """This rank's share of the next round of ``groups x data ranks`` global prompt slots."""
        first = self.prompts_read + self.env.data_rank * groups
        self.prompts_read += groups * self.env.data_world
        return range(first, first + groups)

    def _prompts(self, slots: list[int]) -> list[Prompt]:
        """The usable prompts at ``slots``; the others counted."""
        prompts = []
        for slot in slots:
            try:
                prompt = asked(self.dataset[self._index(slot)], self.encoder, self.tokenizer, slot)
            except BadSample as bad:
                self.stats[f"rollout_{bad.reason}"] += 1
                continue
            if len(prompt.encoded) + self.cfg.training.rl.max_new_tokens + 1 > self.length:
                self.stats["rollout_prompt_too_long"] += 1
                continue
            prompts.append(prompt)
        return prompts

    def _index(self, slot: int) -> int:
        """The sample at ``slot`` of the run's shuffle: a new seeded permutation for each pass over the data, made
        once per pass."""
        n = len(self.dataset)
        epoch, order = self._order
        if epoch != slot // n:
            self._order = epoch, order = slot // n, sample_order(self.cfg.training.seed, slot // n, n)
        return int(order[slot % n])

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

    @paddle.no_grad()
    def _sample(self, prompts: list[Prompt]) -> list[Group]:
        """``rl.group_size`` answers to each prompt, side by side, scored."""
        if not prompts:
            if self.exchange is not None:
                raise DataError("a round of prompts left this data rank none to sample, and with expert "
                                "parallelism or sharding stage 3 every rank of the group decodes in step; see the "
                                "data/skipped_rollout_* counts")
            return []
        t, g = self.cfg.training, self.group_size
        encoded = [p.encoded for p in prompts for _ in range(g)]
        decodings = [Decoding(t.rl.max_new_tokens, t.rl.temperature, t.rl.top_p,
                              seed=(t.seed * 1_000_003 + p.slot) * g + i) for p in prompts for i in range(g)]
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
        groups = []
        for i, prompt in enumerate(prompts):
            mine = answers[i * g:(i + 1) * g]
            texts = [self.tokenizer.decode(a.ids) for a in mine]
            scores = np.array([[reward(text, prompt.reference) for reward in self.rewards] for text in texts])
            weights = np.array([r.weight for r in self.rewards])
            groups.append(Group(prompt, mine, scores.reshape(g, len(self.rewards)), scores @ weights,
                                routes[i * g:(i + 1) * g]))
        return groups

    def _old_policy(self, rows: list[Row], micro_batch_size: int, accumulation_steps: int) -> None:
        """The old policy as the trainer computes it (``router_replay: old_policy``): each row's token
        log-probabilities and routes from a forward of the weights that sampled it, through the run's own layout
        (a pipeline's last stage holds the log-probabilities; the other stages keep the sampler's, unread)."""
        started = time.perf_counter()
        batches = [collate(rows[i:i + micro_batch_size]) for i in range(0, len(rows), micro_batch_size)]
        with recording(self.model) as records:  # a step's micro-batches at a time: a pipeline schedule's shape
            for first in range(0, len(batches), accumulation_steps):
                # what the objective's reference pass keeps: each token's log-probability
                self.runner.logps_pass(batches[first:first + accumulation_steps])
        for i, batch in enumerate(batches):
            mine = rows[i * micro_batch_size:(i + 1) * micro_batch_size]
            reference = batch.objective_inputs.get(REFERENCE_LOGPS)
            if reference is not None:
                for row, logps in zip(mine, host_reads.read(reference, "rollout")):
                    row.inputs[OLD_LOGPS] = logps
            routes = routes_of_forward(records, i, moe_layer_ids(self.model.cfg), len(mine), self.length,
                                       self.model.cfg.moe_k)
            for row, table in zip(mine, routes):
                row.routes = table
        self.window["seconds"] += time.perf_counter() - started

    def _rows(self, group: Group) -> list[Row]:
        """The group's answers as training rows, with their advantages; its figures into the window."""
        scale = self.cfg.training.rl.loss != "dr_grpo"
        advantages = group_advantages(group.rewards, self.group_size, scale)
        w = self.window
        if len(self.answers) < ANSWERS_SHOWN:
            self.answers.append({
                "prompt": render(group.prompt.encoded, self.tokenizer), "reference": group.prompt.reference,
                "answers": [{"text": self.tokenizer.decode(a.ids), "reward": float(total), "advantage": float(adv),
                             "scores": {r.name: float(s) for r, s in zip(self.rewards, scores)}}
                            for a, adv, scores, total in zip(group.answers, advantages, group.scores, group.rewards)]})
        rows = []
        for answer, advantage, scores, total, routes in zip(group.answers, advantages, group.scores, group.rewards,
                                                            group.routes):
            tokens = answer.ids + ([self.tokenizer.eos_id] if answer.stop == "eos" else [])
            row = answer_row(group.prompt.encoded, tokens, self.length, self.tokenizer.pad_id)
            start = len(group.prompt.encoded) - 1  # the position whose label is the answer's first token
            logps = np.zeros(self.length, np.float32)
            logps[start:start + len(tokens)] = answer.logps
            # the sampler's kept where the old policy's forward replaces OLD_LOGPS
            row.inputs = {ADVANTAGES: np.array(advantage, np.float32), OLD_LOGPS: logps, SAMPLER_LOGPS: logps.copy()}
            row.routes = routes
            rows.append(row)
            w["answers"] += 1
            w["answer_tokens"] += len(tokens)
            w["entropy"] += sum(answer.entropies or [])
            w["reward"] += total
            w["reward_sq"] += total * total
            for reward, score in zip(self.rewards, scores):
                w[f"reward_{reward.name}"] += score
                w[f"reward_{reward.name}_sq"] += score * score
        return rows


def answer_row(prompt: Encoded, answer: list[int], length: int, pad_id: int) -> Row:
    """A training row of ``prompt`` followed by the text tokens ``answer``, which are its labels."""
    start = int(prompt.position_ids.max()) + 1
    positions = np.repeat(np.arange(start, start + len(answer))[:, None], 3, axis=1)
    n = len(answer)
    encoded = Encoded(np.append(prompt.input_ids, answer), np.append(np.zeros(len(prompt), bool), np.ones(n, bool)),
                      np.zeros(len(prompt) + n, np.int64), np.append(prompt.token_type_ids, np.zeros(n, np.int64)),
                      np.vstack([prompt.position_ids, positions]), prompt.patches, prompt.grids)
    return make_row([encoded], length, pad_id)


def asked(sample, encoder, tokenizer: Tokenizer, slot: int) -> Prompt:
    """A sample as a prompt and its reference answer. A conversation ending with an answer is asked without it,
    its assistant turn opened as generation opens it (the Thinking template's form where the data or the record
    asks for thinking); any other sample's last trained span is the answer (``split_answer``). BadSample where
    an image or a video is part of the answer."""
    conversation = sample.conversation
    if conversation is not None and conversation.messages[-1]["role"] == "assistant":
        answer = conversation.messages[-1]["content"]
        if any(part["type"] != "text" for part in answer):
            raise BadSample("visual_after_answer", "the answer holds an image or a video")
        question = dataclasses.replace(sample, conversation=dataclasses.replace(
            conversation, messages=conversation.messages[:-1]))
        return Prompt(encoder.prompt(question), "".join(part["text"] for part in answer), slot)
    parts = split_answer(encoder(sample))
    if parts is None:
        raise BadSample("visual_after_answer", "an image or a video follows the answer's start")
    prompt, answer, _ = parts
    answer = answer[:-1] if len(answer) and answer[-1] == tokenizer.eos_id else answer
    return Prompt(prompt, tokenizer.decode(answer.tolist()), slot)
