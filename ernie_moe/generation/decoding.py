"""Greedy and sampled decoding, one forward per new token over a key/value cache."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import paddle

from ..data.packing import Encoded
from .kv_cache import KVCache, forward_cached


@dataclass
class Generated:
    ids: list[int]  # the new tokens, without the end-of-sentence token
    stop: str  # "eos", "length" (max_new_tokens), "positions" (max_position_embeddings) or "caller" (on_token)


def prompt_inputs(prompt: Encoded, channels: int) -> tuple:
    """The first block's input tuple for one encoded prompt."""
    patches = np.concatenate(prompt.patches) if prompt.patches else np.zeros([0, channels], np.float32)
    grids = np.stack(prompt.grids).reshape([-1, 3]) if prompt.grids else np.zeros([0, 3], np.int64)
    return (paddle.to_tensor(prompt.input_ids[None]), paddle.to_tensor(prompt.token_type_ids[None]),
            paddle.to_tensor(prompt.position_ids[None]), paddle.full([1, len(prompt)], len(prompt), dtype="int64"),
            paddle.to_tensor(patches), paddle.to_tensor(grids))


def token_inputs(token: int, position: int, channels: int) -> tuple:
    """The input tuple of one new text token at ``position`` (the same on the t, h and w axes)."""
    return (paddle.to_tensor([[token]]), paddle.zeros([1, 1], dtype="int64"),
            paddle.full([1, 1, 3], position, dtype="int64"), paddle.ones([1, 1], dtype="int64"),
            paddle.zeros([0, channels], dtype="float32"), paddle.zeros([0, 3], dtype="int64"))


def choose(logits: np.ndarray, temperature: float, top_p: float, rng: np.random.Generator) -> int:
    """The next token: the most likely at temperature 0, else drawn from the ``top_p`` nucleus."""
    if temperature <= 0:
        return int(np.argmax(logits))
    scaled = (logits - logits.max()) / temperature
    probs = np.exp(scaled) / np.exp(scaled).sum()
    order = np.argsort(-probs, kind="stable")
    keep = order[: int(np.searchsorted(np.cumsum(probs[order]), top_p) + 1)]
    return int(rng.choice(keep, p=probs[keep] / probs[keep].sum()))


@paddle.no_grad()
def generate(model, prompt: Encoded, max_new_tokens: int, eos_id: int, temperature: float = 0.0,
             top_p: float = 1.0, seed: int = 0, use_cache: bool = True, never: tuple[int, ...] = (),
             tokens: int | None = None, on_token: Callable[[list[int]], bool] | None = None) -> Generated:
    """Continue ``prompt`` (``data.packing.Encoder.prompt``) until the end-of-sentence token,
    ``max_new_tokens`` or the model's last position, never choosing the ids in ``never`` (the image
    placeholder of a model that sees images: images come from the prompt) nor ids from ``tokens`` on (a
    vocabulary larger than the tokenizer's: ids it cannot decode). ``use_cache=False`` runs the whole sequence
    again for every token (the reference the cache is checked against). ``on_token`` sees the new tokens so
    far after each one (a stream); returning True stops there (a stop string)."""
    channels = model.cfg.vision_config.in_channels * model.cfg.vision_config.patch_size ** 2
    rng = np.random.default_rng(seed)
    limit = model.cfg.max_position_embeddings
    position = int(prompt.position_ids.max()) + 1
    cache = KVCache(model.cfg.num_hidden_layers)
    logits = forward_cached(model, prompt_inputs(prompt, channels), cache)
    new: list[int] = []
    while True:
        scores = logits[0, -1].astype("float32").numpy()
        scores[list(never)] = -np.inf
        if tokens is not None:
            scores[tokens:] = -np.inf
        token = choose(scores, temperature, top_p, rng)
        if token == eos_id:
            return Generated(new, "eos")
        new.append(token)
        if on_token is not None and on_token(new):
            return Generated(new, "caller")
        if len(new) >= max_new_tokens:
            return Generated(new, "length")
        if position >= limit:
            return Generated(new, "positions")
        if use_cache:
            logits = forward_cached(model, token_inputs(token, position, channels), cache)
        else:
            logits = forward_cached(model, prompt_inputs(_extended(prompt, new), channels),
                                    KVCache(model.cfg.num_hidden_layers))
        position += 1


def _extended(prompt: Encoded, tokens: list[int]) -> Encoded:
    """The prompt followed by generated text tokens."""
    start = int(prompt.position_ids.max()) + 1
    positions = np.repeat(np.arange(start, start + len(tokens))[:, None], 3, axis=1)
    return Encoded(np.append(prompt.input_ids, tokens), np.append(prompt.target, [False] * len(tokens)),
                   np.append(prompt.scored, [0] * len(tokens)), np.append(prompt.token_type_ids, [0] * len(tokens)),
                   np.vstack([prompt.position_ids, positions]), prompt.patches, prompt.grids)
