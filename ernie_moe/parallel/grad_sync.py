"""Gradient synchronisation for every layout: one owner, :class:`GradSync`.

The loss of each rank was scaled by ``data_world / denominator``, so an average over the data ranks gives the
global token mean. Then:

- shared parameters are averaged over the data ranks. With ``parallel.overlap_grad_sync`` this is fleet's
  bucketed reducer (the one under ``paddle.DataParallel``), which all-reduces each bucket while the backward
  pass goes on; otherwise it is fleet's fused, bucketed all-reduce after the backward pass: with a pipeline
  (fleet's schedule runs the backward), and in a step whose backward is not one pass (a reentrant recompute
  runs a backward of its own per recomputed block, in which a parameter's gradient can arrive twice);
- expert gradients already hold every token their expert group sent them (the all-to-all backward), so they
  are scaled by 1 / data_world and summed over the ranks holding the same experts only: ridden with the
  shared parameters where those ranks are the data ranks, over their own replica group otherwise;
- sequence-parallel parameters (norms on a piece of the sequence) add up their pieces over the tensor-parallel
  ranks, after the backward pass (a few vectors).

At sharding stage 2 and 3 every gradient is summed onto its owner during the backward instead
(``parallel.zero.GradientOwners``), and averaged there when the step's backward passes are done.
"""

from __future__ import annotations

import paddle
from paddle.base import core
from paddle.distributed.fleet.utils.hybrid_parallel_util import fused_allreduce_gradients_with_group

from ..nn.param_spec import spec_of
from ..parallel.env import DistEnv
from . import zero

# fleet's reducer buckets (paddle.DataParallel's defaults): the last bucket small, so that the collective left
# once the backward pass has ended is short
BUCKET_MB, LAST_BUCKET_MB = 25, 1


class _Reducer:
    """fleet's reducer over ``params`` and ``group``: an average over the group, bucket by bucket, started from
    the gradient hooks of the backward pass that :meth:`expect_backward` announced."""

    def __init__(self, params: list, group):
        sizes = [LAST_BUCKET_MB * 1024 * 1024, BUCKET_MB * 1024 * 1024]
        sparse = [False] * len(params)
        buckets = core.eager_assign_group_by_size(params, sparse, sizes)
        self.params = params
        self.reducer = core.EagerReducer(params, list(reversed(buckets)), sparse, group.process_group, sizes, False)

    def expect_backward(self, outputs: list) -> None:
        self.reducer.prepare_for_backward(outputs)


class GradSync:
    """Makes every rank's gradients those of the whole global batch (see the module's text).

    ``groups``: the trainable parameters, ``expert`` (routed experts) and ``non_expert``. ``one_pass()``: whether
    this step's backward is a single pass (no reentrant recompute on now; the memory guard may switch it on).
    The runner calls :meth:`expect_backward` with the outputs of the micro-batch whose backward pass ends the
    step, before that backward, and :meth:`finish` after it.
    """

    def __init__(self, groups: dict[str, list], env: DistEnv, overlap: bool, one_pass=lambda: True,
                 owners: zero.GradientOwners | None = None):
        self.env = env
        self.groups = groups
        self.one_pass = one_pass
        self.reducers: list[_Reducer] = []
        self.overlapped = False  # whether this step's backward synced as it went
        self.expert_scale = 1.0
        self.partial = [p for p in groups["non_expert"] if spec_of(p).partial_over_tp]  # summed over tp ranks
        self.in_reducers: set[int] = set()
        self.owners = owners  # stage 2 and 3: who keeps which gradient
        self.shards = list({id(s): s for s, _ in owners.buckets}.values()) if owners is not None else []
        if env.world_size == 1 or self.shards:
            return
        replicas = env.expert_replica_group
        experts_with_data = replicas is not None and replicas is env.data_group
        if not (overlap and env.pp_group is None and env.data_world > 1):
            return
        shared = groups["non_expert"] + (groups["expert"] if experts_with_data else [])
        if shared:
            self.reducers.append(_Reducer(shared, env.data_group))
        if groups["expert"] and not experts_with_data and replicas is not None:
            self.reducers.append(_Reducer(groups["expert"], replicas))
            # the reducer averages over the replicas; the experts' share is 1 / data_world of their sum
            self.expert_scale = replicas.nranks / env.data_world
        self.in_reducers = {id(p) for reducer in self.reducers for p in reducer.params}

    def expect_backward(self, outputs: list) -> None:
        self.overlapped = bool(self.reducers) and self.one_pass()
        for reducer in self.reducers if self.overlapped else []:
            reducer.expect_backward(outputs)

    def after_backward(self) -> None:
        """A micro-batch's backward is done: at stage 2 and 3 its gradients go to their owners."""
        if self.owners is not None:
            self.owners.flush()

    @paddle.no_grad()
    def finish(self) -> None:
        env, groups = self.env, self.groups
        if env.world_size == 1:
            return
        if self.shards:
            self._finish_owned()
            return
        if env.sequence_parallel:
            fused_allreduce_gradients_with_group(self.partial, env.tp_group, scale=1.0)
        reduced = self.in_reducers if self.overlapped else set()
        shared = [p for p in groups["non_expert"] if id(p) not in reduced]
        if shared and env.data_world > 1:
            fused_allreduce_gradients_with_group(shared, env.data_group, scale=1.0 / env.data_world)
        experts = [p for p in groups["expert"] if p.grad is not None]
        if self.expert_scale != 1.0:
            for param in experts:
                if id(param) in reduced:
                    param.grad.scale_(self.expert_scale)
        rest = [p for p in experts if id(p) not in reduced]
        if rest and env.expert_replica_group is not None:
            fused_allreduce_gradients_with_group(rest, env.expert_replica_group, scale=1.0 / env.data_world)
        else:
            for param in rest:
                param.grad.scale_(1.0 / env.data_world)

    def _finish_owned(self) -> None:
        """Stage 2 and 3: the owners' sums made whole (sequence-parallel pieces, data-parallel copies) and averaged;
        the routed experts that only their expert group holds are complete already."""
        env = self.env
        owned = {id(p) for shard in self.shards for p in shard.owned()}
        partial = [p for p in self.partial if id(p) in owned and p.grad is not None]
        if env.sequence_parallel and partial:
            fused_allreduce_gradients_with_group(partial, env.tp_group, scale=1.0)
        zero.finish_owned(self.shards, 1.0 / env.data_world)
        sharded = {id(p) for shard in self.shards for p in shard.params}
        for param in self.groups["expert"]:
            if id(param) not in sharded and param.grad is not None:
                param.grad.scale_(1.0 / env.data_world)
