"""Token dispatch: sort (token, choice) pairs by expert, drop what exceeds capacity, gather, combine.

``LocalDispatcher`` keeps every expert in this process. The expert-parallel dispatcher
(``ernie_moe.parallel.expert_parallel``) keeps the same ``dispatch`` / ``combine`` contract and moves the
per-expert rows between ranks with all-to-all.
"""

from __future__ import annotations

from dataclasses import dataclass

import paddle


@dataclass
class DispatchState:
    token_index: paddle.Tensor  # [kept] destination row of each dispatched copy
    weights: paddle.Tensor  # [kept] its mixing weight
    routed: paddle.Tensor  # [experts] copies each expert was chosen for (before capacity)
    kept: paddle.Tensor  # [experts] copies each expert processes


class LocalDispatcher:
    def __init__(self, renormalize_kept: bool = False):
        # ERNIE's rule when capacity drops a choice: the token's kept weights are renormalised to sum to 1
        self.renormalize_kept = renormalize_kept

    def route(self, token_index, expert_ids, weights, num_experts: int, capacity):
        """Flatten the choices and keep those within capacity, sorted by expert.

        ``expert_ids``/``weights`` are ``[tokens, k]``; ``capacity`` ``[experts]`` or None for dropless.
        Choices are ordered k-major, so every token's first choice claims a slot before any second choice.
        With ``renormalize_kept`` each token's kept weights are divided by their sum (at least 1e-12).
        Returns (flat token rows, flat weights, flat experts, kept order, routed counts, kept counts).
        """
        k = expert_ids.shape[1]
        flat_expert = expert_ids.T.flatten()
        flat_token = paddle.tile(token_index, [k])
        flat_weight = weights.T.flatten()
        order = paddle.argsort(flat_expert, stable=True)
        routed = paddle.bincount(flat_expert, minlength=num_experts)
        kept = routed
        if capacity is not None:
            sorted_expert = paddle.gather(flat_expert, order)
            first = paddle.cumsum(routed) - routed
            rank_in_expert = paddle.arange(sorted_expert.shape[0]) - paddle.gather(first, sorted_expert)
            order = paddle.masked_select(order, rank_in_expert < paddle.gather(capacity, sorted_expert))
            kept = paddle.bincount(paddle.gather(flat_expert, order), minlength=num_experts)
            if self.renormalize_kept and flat_token.shape[0]:
                totals = paddle.index_add(paddle.zeros([int(flat_token.max()) + 1], flat_weight.dtype),
                                          paddle.gather(flat_token, order), 0, paddle.gather(flat_weight, order))
                flat_weight = flat_weight / paddle.clip(paddle.gather(totals, flat_token), min=1e-12)
        return flat_token, flat_weight, flat_expert, order, routed, kept

    def dispatch(self, x, token_index, expert_ids, weights, num_experts: int, capacity):
        """Split ``x`` rows into one slice per expert; see :meth:`route` for the arguments."""
        flat_token, flat_weight, _, order, routed, kept = self.route(
            token_index, expert_ids, weights, num_experts, capacity)
        state = DispatchState(paddle.gather(flat_token, order), paddle.gather(flat_weight, order), routed, kept)
        inputs = paddle.gather(x, state.token_index)
        return paddle.split(inputs, kept.tolist(), axis=0), state

    def combine(self, expert_outputs: list[paddle.Tensor], state: DispatchState, num_rows: int) -> paddle.Tensor:
        """Weighted sum of each token's expert outputs; dropped choices contribute nothing."""
        out = paddle.concat(expert_outputs, axis=0)
        weighted = out * state.weights.unsqueeze(-1).astype(out.dtype)
        zeros = paddle.zeros([num_rows, out.shape[-1]], dtype=out.dtype)
        return paddle.index_add(zeros, state.token_index, 0, weighted)
