"""Router replay: the experts each token went to in every MoE layer, recorded in one pass and imposed on another.

An MoE model's routing can flip between the pass that sampled an answer and the pass that trains on it (a
capacity set by a different token count, a moved correction bias, float noise at a top-k tie); the policy
ratio then measures routing noise instead of the policy. Replaying the sampling pass's routing in the update
removes it (``training.router_replay``).

A record holds, for each MoE layer in ``moe_layer_ids(cfg)`` order, ``[tokens, k]`` global expert ids over the
flattened ``[rows, seq]`` tokens: the expert a choice went to, :data:`DROPPED` for a choice capacity dropped, or
:data:`NOT_RECORDED` for a token routed afresh by the router (padding; a position the record did not cover). A
replayed layer runs without capacity: the record says which choices were kept.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import paddle

from .. import host_reads
from ..config.schema import ModelConfig

DROPPED, NOT_RECORDED = -1, -2


def moe_layer_ids(model_cfg: ModelConfig) -> list[int]:
    """The decoder layers that hold an MoE block, in order: a record's layer axis."""
    return [i for i in range(model_cfg.num_hidden_layers) if model_cfg.moe_modalities_at(i)]


@contextmanager
def recording(model) -> Iterator[dict[int, list[paddle.Tensor]]]:
    """Inside, each MoE layer of ``model`` appends the routing of every forward (``[tokens, k]``) to its list,
    keyed by decoder layer index."""
    layers = model.moe_layers()
    records: dict[int, list[paddle.Tensor]] = {layer.layer_idx: [] for layer in layers}
    for layer in layers:
        layer.routes_out = records[layer.layer_idx]
    try:
        yield records
    finally:
        for layer in layers:
            layer.routes_out = None


@contextmanager
def replayed(model, routes: list[paddle.Tensor | None]) -> Iterator[None]:
    """Inside, the MoE layers route the tokens of the micro-batches to come, one forward each in this order (a
    pipeline's schedule runs them so), as their ``routes`` ``[rows, moe layers, seq, k]`` say (None: as their
    routers choose). It must span the backward passes too, where a recomputed forward routes again, in the same
    order."""
    if all(r is None for r in routes):
        yield
        return
    layers = model.moe_layers()
    ordinal = {layer_idx: i for i, layer_idx in enumerate(moe_layer_ids(model.cfg))}
    for layer in layers:
        i = ordinal[layer.layer_idx]
        layer.routes_in = deque(None if r is None else r[:, i].reshape([-1, r.shape[-1]]) for r in routes)
        layer.routes_recomputed = deque()
    try:
        yield
    finally:
        for layer in layers:
            layer.routes_in = layer.routes_recomputed = None


def record_of(kept_pairs: paddle.Tensor, token_index: paddle.Tensor, expert_ids: paddle.Tensor,
              num_rows: int) -> paddle.Tensor:
    """The ``[num_rows, k]`` record of one forward: ``expert_ids [n, k]`` (global) of the tokens ``token_index``,
    with :data:`DROPPED` where the choice is not among ``kept_pairs`` (indices into the k-major flattened choices)."""
    n, k = expert_ids.shape
    kept = paddle.zeros([n * k], dtype="int32")
    if kept_pairs.shape[0]:
        kept = paddle.scatter(kept, kept_pairs, paddle.ones(kept_pairs.shape, dtype="int32"))
    kept = kept.reshape([k, n]).T.astype("bool")
    values = paddle.where(kept, expert_ids.astype("int32"), paddle.full_like(expert_ids, DROPPED, dtype="int32"))
    record = paddle.full([num_rows, k], NOT_RECORDED, dtype="int32")
    return paddle.scatter(record, token_index, values) if n else record


def routes_of_forward(records: dict[int, list[paddle.Tensor]], forward: int, layer_ids: list[int], rows: int,
                      length: int, k: int) -> np.ndarray:
    """The routes ``[rows, moe layers, length, k]`` int32 of the ``forward``-th recorded forward of ``[rows,
    length]`` tokens (NOT_RECORDED for another pipeline stage's layers)."""
    out = np.full([rows, len(layer_ids), length, k], NOT_RECORDED, np.int32)
    for i, layer_idx in enumerate(layer_ids):
        if layer_idx in records:
            out[:, i] = host_reads.read(records[layer_idx][forward], "rollout").reshape([rows, length, k])
    return out


def rows_of_generation(records: dict[int, list[paddle.Tensor]], layer_ids: list[int], rows: int,
                       padding: np.ndarray, answers: list[int], length: int) -> np.ndarray:
    """Generation's records (of this process's MoE layers) as the routes of the training rows it gives: ``[rows,
    moe layers, length, k]`` int32.

    The first forward ran the prompts side by side, each left-padded by ``padding[row]``; every later forward one
    new token per row (the j-th: each row's answer token j). A row's training sequence is its prompt, then its
    answer; positions no forward covered (an answer's last token, padding) are NOT_RECORDED.
    """
    k = next(iter(records.values()))[0].shape[-1]
    out = np.full([rows, len(layer_ids), length, k], NOT_RECORDED, np.int32)
    for i, layer_idx in enumerate(layer_ids):
        if layer_idx not in records:  # another pipeline stage's layer
            continue
        forwards = [host_reads.read(r, "decoding") for r in records[layer_idx]]
        prompt = forwards[0].reshape([rows, -1, k])
        steps = forwards[1:]
        for row in range(rows):
            taken = prompt[row, padding[row]:]
            out[row, i, :len(taken)] = taken
            covered = min(answers[row], len(steps))
            for j in range(covered):
                if len(taken) + j < length:
                    out[row, i, len(taken) + j] = steps[j][row]
    return out
