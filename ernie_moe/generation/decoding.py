"""Greedy and sampled decoding, one forward per new token over a key/value cache, for one prompt or several side by
side (one forward per new token for all of them)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import paddle

from .. import host_reads
from ..data.encoding.packing import Encoded
from ..parallel.pipeline import TrainedModel
from .kv_cache import KVCache, forward_cached

NO_TOKEN = -1  # the token type of padding: no expert takes it, no image is written there


@dataclass(frozen=True)
class Decoding:
    """How one prompt is continued."""

    max_new_tokens: int
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    seed: int = 0


@dataclass
class Generated:
    ids: list[int]  # the new tokens, without the end-of-sentence token
    stop: str  # "eos", "length" (max_new_tokens), "positions" (max_position_embeddings) or "caller" (on_token)
    # with ``with_logps``: each chosen token's log-probability under logits / temperature (the whole vocabulary,
    # before top-p), the end-of-sentence token's last when it stopped there, and the entropy it was drawn with
    logps: list[float] | None = None
    entropies: list[float] | None = None
    # with ``top_logps``: the most likely tokens at each step and their log-probabilities, most likely first
    top: list[list[tuple[int, float]]] | None = None
    # speculative decoding (generation.speculative): tokens drafted by the multi-token prediction layers, and kept
    drafted: int = 0
    accepted: int = 0


def batch_inputs(prompts: list[Encoded], channels: int) -> tuple[tuple, np.ndarray]:
    """The first block's input tuple for ``prompts`` side by side, each padded on the left to the longest, and each
    row's padding (its positions hold no token, and no row sees them: ``KVCache(padding=...)``)."""
    longest = max(len(p) for p in prompts)
    padding = np.array([longest - len(p) for p in prompts], dtype=np.int64)
    ids = np.zeros([len(prompts), longest], np.int64)
    types = np.full([len(prompts), longest], NO_TOKEN, np.int64)
    positions = np.zeros([len(prompts), longest, 3], np.int64)
    for row, (prompt, pad) in enumerate(zip(prompts, padding)):
        ids[row, pad:], types[row, pad:], positions[row, pad:] = (prompt.input_ids, prompt.token_type_ids,
                                                                   prompt.position_ids)
    every_patch = [p for prompt in prompts for p in prompt.patches]
    every_grid = [g for prompt in prompts for g in prompt.grids]
    patches = np.concatenate(every_patch) if every_patch else np.zeros([0, channels], np.float32)
    grids = np.stack(every_grid).reshape([-1, 3]) if every_grid else np.zeros([0, 3], np.int64)
    inputs = (paddle.to_tensor(ids), paddle.to_tensor(types), paddle.to_tensor(positions),
              paddle.full([len(prompts), longest], longest, dtype="int64"), paddle.to_tensor(patches),
              paddle.to_tensor(grids))
    return inputs, padding


def prompt_inputs(prompt: Encoded, channels: int) -> tuple:
    """The first block's input tuple for one encoded prompt."""
    return batch_inputs([prompt], channels)[0]


def tokens_inputs(tokens, positions, live: list[bool], channels: int) -> tuple:
    """The input tuple of new text tokens (``tokens``: one per row, or ``[rows, n]``) at their ``positions`` (the
    same on the t, h and w axes); the tokens of a row that is no longer ``live`` are padding."""
    rows = len(tokens)
    ids = np.asarray(tokens, np.int64).reshape([rows, -1])
    types = np.where(np.asarray(live)[:, None], 0, NO_TOKEN).astype(np.int64).repeat(ids.shape[1], axis=1)
    places = np.asarray(positions, np.int64).reshape([rows, -1, 1]).repeat(3, axis=2)
    return (paddle.to_tensor(ids), paddle.to_tensor(types), paddle.to_tensor(places),
            paddle.ones(ids.shape, dtype="int64"), paddle.zeros([0, channels], dtype="float32"),
            paddle.zeros([0, 3], dtype="int64"))


def token_inputs(token: int, position: int, channels: int) -> tuple:
    """The input tuple of one new text token at ``position`` (the same on the t, h and w axes)."""
    return tokens_inputs([token], [position], [True], channels)


def log_softmax(logits: np.ndarray, temperature: float) -> np.ndarray:
    """``log softmax(logits / temperature)`` in float64, temperature 0 read as 1."""
    scaled = logits.astype(np.float64) / (temperature if temperature > 0 else 1.0)
    shifted = scaled - scaled.max()
    return shifted - np.log(np.exp(shifted).sum())


def token_logp(logits: np.ndarray, token: int, temperature: float) -> tuple[float, float]:
    """(``log softmax(logits / temperature)[token]``, the entropy of that distribution), temperature 0 read as 1,
    in float64."""
    log_probs = log_softmax(logits, temperature)
    return float(log_probs[token]), float(-(np.exp(log_probs) * log_probs).sum())


def most_likely(logits: np.ndarray, temperature: float, count: int, choosable: np.ndarray) -> list[tuple[int, float]]:
    """The ``count`` most likely tokens of those that may be chosen (``choosable``: True where one may) and their
    log-probabilities under ``logits / temperature`` over the whole vocabulary, most likely first (ties: the lower
    id first)."""
    log_probs = log_softmax(logits, temperature)
    order = np.argsort(-np.where(choosable, log_probs, -np.inf), kind="stable")[:count]
    return [(int(token), float(log_probs[token])) for token in order if choosable[token]]


def nucleus(logits: np.ndarray, temperature: float, top_p: float) -> tuple[np.ndarray, np.ndarray]:
    """(the ids a token is drawn from at ``temperature`` > 0, most likely first: the ``top_p`` nucleus, their
    probabilities)."""
    scaled = (logits - logits.max()) / temperature
    probs = np.exp(scaled) / np.exp(scaled).sum()
    order = np.argsort(-probs, kind="stable")
    keep = order[: int(np.searchsorted(np.cumsum(probs[order]), top_p) + 1)]
    return keep, probs[keep] / probs[keep].sum()


def choose(logits: np.ndarray, temperature: float, top_p: float, rng: np.random.Generator) -> int:
    """The next token: the most likely at temperature 0, else drawn from the ``top_p`` nucleus."""
    if temperature <= 0:
        return int(np.argmax(logits))
    keep, probs = nucleus(logits, temperature, top_p)
    return int(rng.choice(keep, p=probs))


@paddle.no_grad()
def generate(model: TrainedModel, prompt: Encoded, max_new_tokens: int, eos_id: int, temperature: float = 0.0,
             top_p: float = 1.0, seed: int = 0, use_cache: bool = True, never: tuple[int, ...] = (),
             tokens: int | None = None, on_token: Callable[[list[int]], bool] | None = None) -> Generated:
    """Continue ``prompt`` (``data.encoding.packing.Encoder.prompt``) until the end-of-sentence token,
    ``max_new_tokens`` or the model's last position, never choosing the ids in ``never`` (the image
    placeholder of a model that sees images: images come from the prompt) nor ids from ``tokens`` on (a
    vocabulary larger than the tokenizer's: ids it cannot decode). ``use_cache=False`` runs the whole sequence
    again for every token (the reference the cache is checked against). ``on_token`` sees the new tokens so
    far after each one (a stream); returning True stops there (a stop string)."""
    stream = None if on_token is None else (lambda row, new: on_token(new))
    return generate_batch(model, [prompt], [Decoding(max_new_tokens, temperature, top_p, seed)], eos_id, use_cache,
                          never, tokens, stream)[0]


@paddle.no_grad()
def generate_batch(model: TrainedModel, prompts: list[Encoded], decodings: list[Decoding], eos_id: int,
                   use_cache: bool = True, never: tuple[int, ...] = (), tokens: int | None = None,
                   on_token: Callable[[int, list[int]], bool] | None = None,
                   with_logps: bool = False, lockstep: Callable[[bool], bool] | None = None,
                   top_logps: int = 0) -> list[Generated]:
    """:func:`generate` for several prompts side by side, each with its own :class:`Decoding`: one forward per new
    token for all of them, each row's logits read back together. Each prompt's answer is the one :func:`generate`
    gives it alone where the MoE layers are dropless, as an evaluation's are unless ``moe_capacity`` sets an
    evaluation factor (the batch's tokens then set the capacity). ``on_token(row, new)``: as :func:`generate`'s,
    per row; ``with_logps``: each answer with its tokens' log-probabilities and entropies (:class:`Generated`),
    and with ``top_logps`` the most likely tokens of each step;
    ``lockstep(finished)``: whether any of the processes that run every forward together (an expert-parallel
    group exchanging tokens) has not finished, told whether this one has; a finished one feeds padding until all
    have. Drafting tokens with the model's multi-token prediction layers: ``speculative.generate_drafting``."""
    channels = model.cfg.vision_config.in_channels * model.cfg.vision_config.patch_size ** 2
    rngs = [np.random.default_rng(d.seed) for d in decodings]
    limit = model.cfg.max_position_embeddings
    positions = [int(p.position_ids.max()) + 1 for p in prompts]
    inputs, padding = batch_inputs(prompts, channels)
    cache = KVCache(model.cfg.num_hidden_layers, padding)
    logits = forward_cached(model, inputs, cache)
    new: list[list[int]] = [[] for _ in prompts]
    logps: list[tuple[list, list, list | None] | None] = [
        ([], [], [] if top_logps else None) if with_logps or top_logps else None for _ in prompts]
    done: list[Generated | None] = [None] * len(prompts)
    while True:
        raw = host_reads.read(model.plan.full_logits(logits[:, -1]).astype("float32"), "decoding")  # every row's
        scores = choosable(raw, never, tokens)  # a log-probability is the model's, over the whole vocabulary
        for row, out in enumerate(done):
            if out is None:
                done[row] = _next(row, scores[row], raw[row], new[row], logps[row], decodings[row], rngs[row],
                                  eos_id, positions[row] >= limit, on_token, top_logps)
        finished = all(out is not None for out in done)
        if not (lockstep(finished) if lockstep is not None else not finished):
            answers = [out for out in done if out is not None]
            assert len(answers) == len(done)  # the ranks go on together until every row of each has ended
            return answers
        live = [out is None for out in done]
        if use_cache:
            last = [ids[-1] if ids else 0 for ids in new]  # a row stopped before its first token feeds padding
            logits = forward_cached(model, tokens_inputs(last, positions, live, channels), cache)
        else:
            whole, padding = batch_inputs([_extended(p, ids) for p, ids in zip(prompts, new)], channels)
            logits = forward_cached(model, whole, KVCache(model.cfg.num_hidden_layers, padding))
        positions = [p + 1 if alive else p for p, alive in zip(positions, live)]


def choosable(logits: np.ndarray, never: tuple[int, ...], tokens: int | None) -> np.ndarray:
    """A copy of ``logits`` (read back, ``[..., vocab]``) with the ids that may not be chosen at -inf: ``never``,
    and those from ``tokens`` on (ids the tokenizer cannot decode)."""
    scores = logits.copy()
    scores[..., list(never)] = -np.inf
    if tokens is not None:
        scores[..., tokens:] = -np.inf
    return scores


def _next(row: int, scores: np.ndarray, logits: np.ndarray, new: list[int],
          figures: tuple[list, list, list | None] | None, decoding: Decoding, rng, eos_id: int,
          at_last_position: bool, on_token, top: int = 0) -> Generated | None:
    """Choose one row's next token from ``scores`` into ``new`` (and its log-probability and entropy under
    ``logits`` into ``figures``, unless None, with the ``top`` most likely tokens); its :class:`Generated` once it
    stops, else None."""
    token = choose(scores, decoding.temperature, decoding.top_p, rng)
    if figures is not None:
        logps, entropies, alternatives = figures
        logp, entropy = token_logp(logits, token, decoding.temperature)
        logps.append(logp)
        entropies.append(entropy)
        if alternatives is not None:
            alternatives.append(most_likely(logits, decoding.temperature, top, np.isfinite(scores)))
    return taken(row, token, new, figures, decoding, eos_id, at_last_position, on_token)


def taken(row: int, token: int, new: list[int], figures, decoding: Decoding, eos_id: int, at_last_position: bool,
          on_token) -> Generated | None:
    """``token`` chosen for ``row``: into ``new`` unless it ends the answer; the row's :class:`Generated` once it
    stops (the end-of-sentence token, ``on_token``, ``max_new_tokens``, the model's last position), else None."""

    def stopped(reason: str) -> Generated:
        return Generated(new, reason, *(figures or ()))

    if token == eos_id:
        return stopped("eos")
    new.append(token)
    if on_token is not None and on_token(row, new):
        return stopped("caller")
    if len(new) >= decoding.max_new_tokens:
        return stopped("length")
    if at_last_position:
        return stopped("positions")
    return None


def _extended(prompt: Encoded, tokens: list[int]) -> Encoded:
    """The prompt followed by generated text tokens."""
    start = int(prompt.position_ids.max()) + 1
    positions = np.repeat(np.arange(start, start + len(tokens))[:, None], 3, axis=1)
    return Encoded(np.append(prompt.input_ids, tokens), np.append(prompt.target, [False] * len(tokens)),
                   np.append(prompt.scored, [0] * len(tokens)), np.append(prompt.token_type_ids, [0] * len(tokens)),
                   np.vstack([prompt.position_ids, positions]), prompt.patches, prompt.grids)
