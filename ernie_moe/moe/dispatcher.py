"""Token dispatch: sort (token, choice) pairs by expert, drop what exceeds capacity, gather, combine.

``LocalDispatcher`` keeps every expert in this process. The dispatchers of ``ernie_moe.parallel.expert_parallel``
share its routing and its combine, and differ only in where the rows go (``dispatch``) and how the expert
outputs come back (``rows_back``): by all-to-all, or gathered over the tensor-parallel ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

import paddle

from .. import host_reads
from ..nn import kernels


@dataclass
class Choices:
    """Every (token, choice) pair of a layer's routing, flattened k-major, and which of them capacity kept."""

    token: paddle.Tensor  # [tokens * k] row of the flattened hidden state
    weight: paddle.Tensor  # [tokens * k] mixing weight
    expert: paddle.Tensor  # [tokens * k] expert id
    order: paddle.Tensor  # [kept] indices of the kept pairs, sorted by expert
    routed: paddle.Tensor  # [experts] pairs per expert before capacity
    kept: paddle.Tensor  # [experts] pairs per expert after it


@dataclass
class DispatchState:
    token_index: paddle.Tensor  # [kept] destination row of each dispatched copy
    weights: paddle.Tensor  # [kept] its mixing weight
    routed: paddle.Tensor  # [experts] copies each expert was chosen for (before capacity)
    kept: paddle.Tensor  # [experts] copies each expert processes
    k: int  # choices per token: at most this many copies of a token come back
    kept_pairs: paddle.Tensor | None = None  # indices of the kept choices among the k-major flattened ones


class LocalDispatcher:
    """Every expert in this process. Subclasses move the rows elsewhere and back; routing and the weighted
    combine are the same for all."""

    def __init__(self, renormalize_kept: bool = False):
        # ERNIE's rule when capacity drops a choice: the token's kept weights are renormalised to sum to 1
        self.renormalize_kept = renormalize_kept

    def route(self, token_index, expert_ids, weights, num_experts: int, capacity, num_rows: int,
              keep: paddle.Tensor | None = None) -> Choices:
        """Flatten the choices and keep those within capacity, sorted by expert.

        ``expert_ids``/``weights`` are ``[tokens, k]``; ``capacity`` ``[experts]`` or None for dropless;
        ``num_rows``: the rows of the hidden state that ``token_index`` points into; ``keep`` ``[tokens, k]``: the
        choices kept, in place of a capacity (a replayed routing, ``moe.replay``).
        Choices are ordered k-major, so every token's first choice claims a slot before any second choice.
        With ``renormalize_kept`` each token's kept weights are divided by their sum (at least 1e-12).
        """
        k = expert_ids.shape[1]
        flat_expert = expert_ids.T.flatten()
        flat_token = paddle.tile(token_index, [k])
        flat_weight = weights.T.flatten()
        order = paddle.argsort(flat_expert, stable=True)  # stable: within an expert, first choices first
        routed = kept = paddle.bincount(flat_expert, minlength=num_experts)
        if keep is not None or capacity is not None:
            if keep is not None:
                order = paddle.masked_select(order, paddle.gather(keep.T.flatten(), order))
            else:
                sorted_expert = paddle.gather(flat_expert, order)
                rank_in_expert = kernels.ranks_within_groups(sorted_expert, routed)
                order = paddle.masked_select(order, rank_in_expert < paddle.gather(capacity, sorted_expert))
            kept = paddle.bincount(paddle.gather(flat_expert, order), minlength=num_experts)
            routed = kept if keep is not None else routed  # a replay's dropped choices routed nowhere
            if self.renormalize_kept and flat_token.shape[0]:
                totals = paddle.index_add(paddle.zeros([num_rows], flat_weight.dtype),
                                          paddle.gather(flat_token, order), 0, paddle.gather(flat_weight, order))
                flat_weight = flat_weight / paddle.clip(paddle.gather(totals, flat_token), min=1e-12)
        return Choices(flat_token, flat_weight, flat_expert, order, routed, kept)

    def dispatch(self, x, token_index, expert_ids, weights, num_experts: int, capacity, keep=None):
        """The ``x`` rows of this process's experts, sorted by expert, and the row count of each expert; see
        :meth:`route` for the arguments."""
        c = self.route(token_index, expert_ids, weights, num_experts, capacity, x.shape[0], keep)
        state = DispatchState(paddle.gather(c.token, c.order), paddle.gather(c.weight, c.order), c.routed, c.kept,
                              expert_ids.shape[1], kept_pairs=c.order)
        return paddle.gather(x, state.token_index), host_reads.read(c.kept, "expert_rows").tolist(), state

    def combine(self, expert_rows: paddle.Tensor, state: DispatchState, num_rows: int) -> paddle.Tensor:
        """Weighted sum of each token's expert outputs; dropped choices contribute nothing."""
        return kernels.weighted_combine(self.rows_back(expert_rows, state), state.token_index, state.weights,
                                        num_rows, state.k)

    def rows_back(self, expert_rows: paddle.Tensor, state: DispatchState) -> paddle.Tensor:
        """The expert outputs (in the order :meth:`dispatch` gave them) as rows in the order of
        ``state.token_index``."""
        return expert_rows
