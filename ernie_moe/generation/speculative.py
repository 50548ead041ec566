"""Speculative decoding with the model's multi-token prediction (MTP) layers: the first MTP depth drafts the next
tokens, and one forward of the model checks them all.

Each step feeds the model, per row, the token just chosen and the k drafts after it. The model's logits at each fed
token say what follows it; the drafts are checked in order. A draft is kept when those logits would choose it:
greedily, when it is their most likely token; in sampling, with probability min(1, p(draft) / q(draft)) (p: the
model's distribution after temperature and top-p, q: the draft's), else the token there is drawn from max(0, p - q)
renormalised, which keeps the model's distribution exactly, and the drafts after it are dropped. When all k are kept
the logits at the last give one more token: a step gives 1 to k + 1 tokens. Rejected drafts' keys and values stay in
the caches, seen by no later token (``KVCache.hide``).

The MTP depth then runs over the same positions with its own cache, slot for slot with the model's (each position
with the model's hidden states there and the embedding of the token after it), and drafts the token after the
step's last one. Further drafts chain the depth on its own output, as EAGLE and SGLang's MTP drafting do: its
hidden states stand for the model's at the drafted token, whose embedding goes in beside them. Those chained
positions leave the depth's cache once drafted: the next step computes them from the model's hidden states.

Greedy answers are those of plain decoding (``decoding.generate_batch``) token for token, as long as the MoE layers
are dropless (more tokens per row change an evaluation capacity's token count).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager

import numpy as np
import paddle

from .. import host_reads
from ..cli import DRAFT_TOKENS
from ..data.encoding.packing import Encoded
from ..model.blocks import ImageFeatures
from ..model.ernie_vl import ErnieMoEForConditionalGeneration
from ..model.mtp import MultiTokenPrediction
from ..parallel.pipeline import TrainedModel
from ..parallel.zero import held
from .decoding import (
    NO_TOKEN,
    Decoding,
    Generated,
    batch_inputs,
    choosable,
    choose,
    generate_batch,
    nucleus,
    taken,
    tokens_inputs,
)
from .kv_cache import KVCache, forward_cached


def drafter(model: TrainedModel) -> MultiTokenPrediction | None:
    """The model's multi-token prediction layers, where it has them (the whole model in one process: not a
    pipeline stage), whether or not the run trains them."""
    if not isinstance(model, ErnieMoEForConditionalGeneration):
        return None
    return next((b for b in model.blocks() if isinstance(b, MultiTokenPrediction)), None)


def distribution(scores: np.ndarray, temperature: float, top_p: float) -> np.ndarray:
    """The distribution :func:`decoding.choose` draws from, over the whole vocabulary (temperature 0: the most
    likely token)."""
    out = np.zeros(len(scores))
    if temperature <= 0:
        out[int(np.argmax(scores))] = 1.0
        return out
    keep, probs = nucleus(scores.astype(np.float64), temperature, top_p)
    out[keep] = probs
    return out / out.sum()


def verify(p: np.ndarray, q: np.ndarray, draft: int, rng: np.random.Generator) -> tuple[bool, int]:
    """(whether ``draft``, drawn from ``q``, is kept; the token): kept with probability min(1, p / q) at the draft,
    else a token drawn from max(0, p - q) renormalised. The token is distributed as ``p``, whatever ``q`` is."""
    if p[draft] >= q[draft] or rng.random() < p[draft] / q[draft]:
        return True, draft
    residual = np.maximum(p - q, 0.0)
    return False, int(rng.choice(len(p), p=residual / residual.sum()))


class _Rows:
    """What each row has so far: its answer, the token it feeds next and the drafts after it, its position."""

    def __init__(self, prompts: list[Encoded], decodings: list[Decoding], eos_id: int, limit: int, on_token):
        self.decodings, self.eos_id, self.limit, self.on_token = decodings, eos_id, limit, on_token
        self.rngs = [np.random.default_rng(d.seed) for d in decodings]
        self.positions = [int(p.position_ids.max()) + 1 for p in prompts]  # of the token each row feeds next
        self.new: list[list[int]] = [[] for _ in prompts]
        self.done: list[Generated | None] = [None] * len(prompts)
        self.next = [0] * len(prompts)  # the token each row feeds next
        self.drafts: list[list[int]] = [[] for _ in prompts]  # the drafts after it, and their distributions
        self.draft_probs: list[list[np.ndarray]] = [[] for _ in prompts]
        self.drafted, self.accepted = [0] * len(prompts), [0] * len(prompts)

    @property
    def live(self) -> list[bool]:
        return [out is None for out in self.done]

    def take(self, row: int, token: int, position: int) -> bool:
        """``token`` for ``row``, at ``position``: whether the row goes on."""
        self.done[row] = taken(row, token, self.new[row], None, self.decodings[row], self.eos_id,
                               position >= self.limit, self.on_token)
        self.next[row] = token
        return self.done[row] is None

    def draft(self, row: int, scores: np.ndarray) -> int:
        """One more draft for ``row`` from the MTP depth's ``scores``."""
        d = self.decodings[row]
        q = distribution(scores, d.temperature, d.top_p)
        token = int(np.argmax(q)) if d.temperature <= 0 else int(self.rngs[row].choice(len(q), p=q))
        self.drafts[row].append(token)
        self.draft_probs[row].append(q)
        return token

    def check(self, row: int, scores: np.ndarray) -> tuple[list[int], int]:
        """One row's step over the logits at its fed tokens (``[1 + drafts, vocab]``): its drafts kept in order
        until one is not, which is replaced, or the token after the last. Returns (the token after each fed
        position, padded with the last, for the MTP depth; how many drafts were kept)."""
        d, position, rng = self.decodings[row], self.positions[row], self.rngs[row]
        after, kept = [], 0
        for draft, q, logits in zip(self.drafts[row], self.draft_probs[row], scores):
            if position + 1 >= self.limit:  # the draft's position is past the model's last
                break
            self.drafted[row] += 1
            ok, token = verify(distribution(logits, d.temperature, d.top_p), q, draft, rng)
            self.accepted[row] += ok
            position += 1
            after.append(token)
            if not (self.take(row, token, position) and ok):
                break
            kept += 1
        if len(after) == kept:  # every draft kept, or the position limit before a check: the logits there choose
            position += 1
            token = choose(scores[kept], d.temperature, d.top_p, rng)
            after.append(token)
            self.take(row, token, position)
        self.positions[row] = position
        self.drafts[row], self.draft_probs[row] = [], []
        return after + [after[-1]] * (len(scores) - len(after)), kept

    def finished(self) -> list[Generated]:
        answers = [out for out in self.done if out is not None]
        assert len(answers) == len(self.done)  # called once no row is live
        for out, drafted, accepted in zip(answers, self.drafted, self.accepted):
            out.drafted, out.accepted = drafted, accepted
        return answers


@paddle.no_grad()
def generate_drafting(model: TrainedModel, prompts: list[Encoded], decodings: list[Decoding], eos_id: int,
                      never: tuple[int, ...] = (), tokens: int | None = None,
                      on_token: Callable[[int, list[int]], bool] | None = None,
                      draft_tokens: int = DRAFT_TOKENS) -> list[Generated]:
    """``decoding.generate_batch`` with ``draft_tokens`` drafts per step where the model has multi-token
    prediction layers (:func:`generate_speculative`); without them, or with no drafts, ``generate_batch`` itself."""
    if draft_tokens and drafter(model) is not None:
        return generate_speculative(model, prompts, decodings, eos_id, never, tokens, on_token, draft_tokens)
    return generate_batch(model, prompts, decodings, eos_id, never=never, tokens=tokens, on_token=on_token)


def generate_speculative(model: TrainedModel, prompts: list[Encoded], decodings: list[Decoding], eos_id: int,
                         never: tuple[int, ...] = (), tokens: int | None = None,
                         on_token: Callable[[int, list[int]], bool] | None = None,
                         draft_tokens: int = DRAFT_TOKENS) -> list[Generated]:
    """``decoding.generate_batch`` with ``draft_tokens`` drafts per step from the model's first MTP depth
    (:func:`drafter`); each answer counts its drafted and kept tokens (``Generated.drafted``, ``accepted``)."""
    mtp = drafter(model)
    if mtp is None:
        raise ValueError("speculative decoding drafts with the model's multi-token prediction layers: it has none")
    # sharding stage 3: the depth and the token embedding run outside their blocks' forward
    with carried_embeddings(model), held(model, [*mtp.parameters(), *model.model.embed_tokens.parameters()]):
        return _generate_speculative(model, mtp, prompts, decodings, eos_id, never, tokens, on_token, draft_tokens)


@contextmanager
def carried_embeddings(model: TrainedModel):
    """The input embeddings carried past the decoder layers, which the depth reads, also where the run does not
    train it (``model.blocks.set_objective``)."""
    images = next(b for b in model.blocks() if isinstance(b, ImageFeatures))
    was, images.carries_embeddings = images.carries_embeddings, True
    try:
        yield
    finally:
        images.carries_embeddings = was


def _generate_speculative(model: TrainedModel, mtp: MultiTokenPrediction, prompts: list[Encoded],
                          decodings: list[Decoding], eos_id: int, never: tuple[int, ...], tokens: int | None,
                          on_token: Callable[[int, list[int]], bool] | None, draft_tokens: int) -> list[Generated]:
    channels = model.cfg.vision_config.in_channels * model.cfg.vision_config.patch_size ** 2

    def scored(logits: paddle.Tensor) -> np.ndarray:
        """Every row's logits, read back, with the tokens that may not be chosen at -inf."""
        return choosable(host_reads.read(model.plan.full_logits(logits).astype("float32"), "decoding"), never, tokens)

    rows = _Rows(prompts, decodings, eos_id, model.cfg.max_position_embeddings, on_token)
    count = len(prompts)
    inputs, padding = batch_inputs(prompts, channels)
    cache = KVCache(model.cfg.num_hidden_layers, padding, drafts=1)
    logits, kept = forward_cached(model, inputs, cache, keep=True)
    first = scored(logits[:, -1])
    for row, d in enumerate(decodings):
        rows.take(row, choose(first[row], d.temperature, d.top_p, rows.rngs[row]), rows.positions[row])
    # the MTP depth over the prompt: each position with the embedding of the token after it (the last: the one
    # just chosen), at that token's position
    ahead = paddle.concat([kept[5][:, 1:], _embedded(model, [[t] for t in rows.next])], axis=1)
    positions = paddle.concat([inputs[2][:, 1:], _places([[p] for p in rows.positions])], axis=1)
    hidden = mtp.decode(kept[0], ahead, inputs[1], positions, cache.bounds(count, cache.length, 0), cache.drafts[0])
    _chain(model, mtp, rows, cache, scored, hidden[:, -1:], draft_tokens)
    while any(rows.live):
        live = rows.live
        fed = [[t, *d] + [0] * (draft_tokens - len(d)) for t, d in zip(rows.next, rows.drafts)]
        places = [[p + i for i in range(len(f))] for p, f in zip(rows.positions, fed)]
        logits, kept = forward_cached(model, tokens_inputs(fed, places, live, channels), cache, keep=True)
        scores, first_slot = scored(logits), cache.length - len(fed[0])
        after, last = [[0] * len(fed[0]) for _ in fed], [0] * count  # each fed position's next token; the last kept
        for row, alive in enumerate(live):
            if alive:
                after[row], last[row] = rows.check(row, scores[row])
                for slot in range(first_slot + last[row] + 1, cache.length):
                    cache.hide(count, row, slot)
        types = paddle.to_tensor(np.where(np.array(live)[:, None], 0, NO_TOKEN).repeat(len(fed[0]), axis=1))
        bounds = cache.bounds(count, len(fed[0]), first_slot)
        hidden = mtp.decode(kept[0], _embedded(model, after), types, _places(places, 1), bounds, cache.drafts[0])
        slots = paddle.to_tensor(np.array(last, np.int64)[:, None, None])
        _chain(model, mtp, rows, cache, scored, paddle.take_along_axis(hidden, slots, axis=1, broadcast=True),
               draft_tokens)
    return rows.finished()


def _embedded(model: TrainedModel, ids) -> paddle.Tensor:
    return model.model.embed_tokens(paddle.to_tensor(np.array(ids, np.int64)))


def _places(positions, ahead: int = 0) -> paddle.Tensor:
    """``[rows, n]`` positions (plus ``ahead``) as the ``[rows, n, 3]`` position ids of text tokens."""
    return paddle.to_tensor((np.array(positions, np.int64) + ahead)[:, :, None].repeat(3, axis=2))


def _chain(model: TrainedModel, mtp: MultiTokenPrediction, rows: _Rows, cache: KVCache, scored, hidden: paddle.Tensor,
           count: int) -> None:
    """``count`` drafts for each live row: the first from the MTP depth's hidden states ``[rows, 1, width]`` at the
    row's last position, each further one from the depth run again on its own output and the last draft's
    embedding, at that draft's position; those chained keys and values leave the depth's cache afterwards."""
    layer, length, live = cache.drafts[0], cache.length, rows.live
    for step in range(count):
        scores = scored(model.head(model.model.norm(hidden))[:, 0])
        last = [rows.draft(row, scores[row]) if alive else 0 for row, alive in enumerate(live)]
        if step == count - 1:
            break
        types = paddle.to_tensor(np.where(np.array(live)[:, None], 0, NO_TOKEN).astype(np.int64))
        places = _places([[p + step + 1] for p in rows.positions])  # the last draft's position
        bounds = cache.bounds(len(live), 1, length + step)
        hidden = mtp.decode(hidden, _embedded(model, [[t] for t in last]), types, places, bounds, layer)
    layer.truncate(length)
