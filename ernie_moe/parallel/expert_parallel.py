"""Expert parallelism: each modality's experts split evenly over an expert group, tokens moved by all-to-all.

Rank r of an expert group of size P holds, of every expert segment (text experts, then vision experts)
of n experts, the experts ``[r * n / P, (r + 1) * n / P)``. Its local experts are ordered segment by
segment, which is also the order of ERNIE's global numbering restricted to the rank.

Two ways to reach them: ranks of an expert group carved from the data ranks see different tokens and
exchange rows by all-to-all (``ExpertParallelDispatcher``); tensor-parallel ranks (``moe_group: mp``) see the
same tokens, so each takes its experts' rows locally and the outputs are gathered
(``TensorParallelExpertDispatcher``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import paddle
import paddle.distributed as dist

from .. import host_reads
from ..moe.dispatcher import DispatchState, LocalDispatcher
from ..nn.sharding import shard_index
from .comm import CopyToGroup, GatherRows, all_to_all


def local_expert_ids(counts: list[int], rank: int, size: int) -> list[int]:
    """Global ids of the experts ``rank`` holds, in local order: its share of every modality's segment."""
    return shard_index(counts, rank, size).tolist()


def rank_major_order(counts: list[int], size: int) -> np.ndarray:
    """position[e]: where global expert e sits when experts are listed owner by owner, local order inside."""
    order = [e for rank in range(size) for e in local_expert_ids(counts, rank, size)]
    position = np.empty(len(order), np.int64)
    position[order] = np.arange(len(order))
    return position


@dataclass
class ExpertParallelState(DispatchState):
    send_splits: list[int] = field(default_factory=list)  # rows sent to each rank of the group
    recv_splits: list[int] = field(default_factory=list)  # rows received from each rank
    to_expert_major: paddle.Tensor | None = None  # received rows (source-major) -> local-expert-major


class _ByOwner(LocalDispatcher):
    """Routing with the kept choices ordered by the rank that owns their expert, then its local expert."""

    def __init__(self, counts: list[int], group, renormalize_kept: bool = False):
        super().__init__(renormalize_kept)
        self.group = group
        self.size, self.rank = group.nranks, group.rank
        self.local = sum(counts) // self.size
        self.position = paddle.to_tensor(rank_major_order(counts, self.size))

    def route_by_owner(self, token_index, expert_ids, weights, num_experts, capacity, num_rows, keep=None):
        """Returns (token rows, weights, routed, kept, choices per [owner rank x local expert], the kept choices'
        indices among the flattened ones)."""
        c = self.route(token_index, expert_ids, weights, num_experts, capacity, num_rows, keep)
        position = paddle.gather(self.position, paddle.gather(c.expert, c.order))
        regroup = paddle.argsort(position, stable=True)
        order = paddle.gather(c.order, regroup)
        per_slot = paddle.bincount(paddle.gather(position, regroup), minlength=num_experts)
        return paddle.gather(c.token, order), paddle.gather(c.weight, order), c.routed, c.kept, per_slot, c.order


class ExpertParallelDispatcher(_ByOwner):
    def dispatch(self, x, token_index, expert_ids, weights, num_experts, capacity, keep=None):
        rows, row_weights, routed, kept, per_slot, kept_pairs = self.route_by_owner(
            token_index, expert_ids, weights, num_experts, capacity, x.shape[0], keep)
        table: list[paddle.Tensor] = []
        dist.all_gather(table, per_slot, group=self.group)
        counts = host_reads.read(paddle.stack(table), "expert_rows").reshape(self.size, self.size, self.local)
        # counts: [source rank, destination rank, local expert]
        send_splits = counts[self.rank].sum(axis=1).tolist()
        mine = counts[:, self.rank, :]  # [src, local expert]
        recv_splits = mine.sum(axis=1).tolist()

        received = all_to_all(paddle.gather(x, rows), send_splits, recv_splits, self.group)
        # received is source-major; the experts want their rows together
        starts = np.concatenate([[0], np.cumsum(mine.reshape(-1))[:-1]]).reshape(mine.shape)
        expert_major = [np.arange(starts[s, e], starts[s, e] + mine[s, e])
                        for e in range(self.local) for s in range(self.size)]
        index = paddle.to_tensor(np.concatenate(expert_major) if expert_major else np.zeros([0], np.int64))
        state = ExpertParallelState(rows, row_weights, routed, kept, expert_ids.shape[1], kept_pairs,
                                    send_splits, recv_splits, index)
        inputs = paddle.gather(received, index) if received.shape[0] else received
        return inputs, mine.sum(axis=0).tolist(), state

    def rows_back(self, expert_rows, state: DispatchState):
        assert isinstance(state, ExpertParallelState)  # what this dispatcher's dispatch returned
        source_major = paddle.zeros_like(expert_rows)
        if expert_rows.shape[0] and state.to_expert_major is not None:  # set with any row received
            source_major = paddle.scatter(source_major, state.to_expert_major, expert_rows)
        return all_to_all(source_major, state.recv_splits, state.send_splits, self.group)


@dataclass
class TensorParallelExpertState(DispatchState):
    block_sizes: list[int] = field(default_factory=list)  # rows each rank's experts processed, in rank order


class TensorParallelExpertDispatcher(_ByOwner):
    """Experts spread over ranks that hold the same tokens: no all-to-all, one gather of the outputs.

    Routing runs identically on every rank. Each rank picks the rows of its own experts; the expert
    outputs are gathered so every rank combines all of them with the (replicated) routing weights, which
    keeps the router's gradient complete on every rank.
    """

    def dispatch(self, x, token_index, expert_ids, weights, num_experts, capacity, keep=None):
        rows, row_weights, routed, kept, per_slot, kept_pairs = self.route_by_owner(
            token_index, expert_ids, weights, num_experts, capacity, x.shape[0], keep)
        seen: list[paddle.Tensor] = []
        dist.all_gather(seen, per_slot, group=self.group)
        seen = host_reads.read(paddle.stack(seen), "expert_rows")
        per_slot = seen[self.rank]
        if (seen != per_slot).any():
            raise RuntimeError("tensor-parallel ranks routed their (identical) tokens differently; their inputs "
                               "or router weights have diverged")
        per_rank = per_slot.reshape(self.size, self.local)
        start = int(per_rank[: self.rank].sum())
        mine = rows[start: start + int(per_rank[self.rank].sum())]
        # Only this rank's experts use these rows: their input gradient is summed over the ranks.
        inputs = paddle.gather(CopyToGroup.apply(x, self.group), mine)
        state = TensorParallelExpertState(rows, row_weights, routed, kept, expert_ids.shape[1], kept_pairs,
                                          per_rank.sum(axis=1).tolist())
        return inputs, per_rank[self.rank].tolist(), state

    def rows_back(self, expert_rows, state: DispatchState):
        assert isinstance(state, TensorParallelExpertState)  # what this dispatcher's dispatch returned
        return GatherRows.apply(expert_rows, state.block_sizes, self.group)
