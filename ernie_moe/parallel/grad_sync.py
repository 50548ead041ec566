"""Gradient synchronisation for layouts that fleet's data-parallel wrapper does not cover (tensor, sequence,
expert parallelism and optimizer sharding)."""

from __future__ import annotations

import paddle
from paddle.distributed.fleet.utils.hybrid_parallel_util import fused_allreduce_gradients_with_group


@paddle.no_grad()
def sync_gradients(groups: dict[str, list], env) -> None:
    """Make every rank's gradients those of the whole global batch.

    The loss of each rank was scaled by ``data_world / denominator`` so that an average over the data ranks
    gives the global token mean. Then:
    - sequence-parallel parameters (norms on a piece of the sequence) add up their pieces over the
      tensor-parallel ranks;
    - shared parameters are averaged over the data ranks (fleet's fused, bucketed all-reduce);
    - expert gradients already hold every token their expert group sent them (the all-to-all backward), so
      they are scaled by 1 / data_world and summed only over ranks holding the same experts.
    """
    if env.world_size == 1 or env.pure_data_parallel:
        return
    if env.sequence_parallel:
        partial = [p for p in groups["non_expert"] if getattr(p, "sequence_parallel", False)]
        fused_allreduce_gradients_with_group(partial, env.tp_group, scale=1.0)
    if env.data_world > 1:
        fused_allreduce_gradients_with_group(groups["non_expert"], env.data_group, scale=1.0 / env.data_world)
    for param in groups["expert"]:
        if param.grad is not None:
            param.grad.scale_(1.0 / env.data_world)
            if env.expert_replica_group is not None:
                env.all_reduce_sum(param.grad, env.expert_replica_group)
