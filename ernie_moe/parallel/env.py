"""Process setup through fleet: every launched process is a data-parallel rank; expert groups are carved
out of the data-parallel ranks when ``expert_parallel_degree`` > 1."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import paddle
import paddle.distributed as dist
from paddle.distributed import fleet

from . import cpu_fallbacks


@dataclass
class DistEnv:
    rank: int = 0
    world_size: int = 1
    hcg: object = None  # fleet's HybridCommunicateGroup
    ep_group: object = None  # ranks that split the experts between them
    expert_replica_group: object = None  # ranks holding the same experts (None when there is one copy)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def all_reduce_sum(self, tensor: paddle.Tensor, group=None) -> paddle.Tensor:
        """Sum over ranks (in place); a no-op on one process, where the global group does not exist."""
        if self.world_size > 1:
            dist.all_reduce(tensor, group=group)
        return tensor

    def all_gather(self, tensor: paddle.Tensor) -> list[paddle.Tensor]:
        """Every rank's ``tensor``, in rank order."""
        if self.world_size == 1:
            return [tensor]
        gathered: list[paddle.Tensor] = []
        dist.all_gather(gathered, tensor)
        return gathered


def check_layout(parallel_cfg, world_size: int) -> None:
    """Degrees that do not fit the launched processes; raises ConfigError before any group is built."""
    from ..config import ConfigError

    ep = parallel_cfg.expert_parallel_degree
    if world_size % ep:
        raise ConfigError(f"parallel.expert_parallel_degree ({ep}) must divide the number of processes "
                          f"({world_size}): expert groups are carved out of the data-parallel ranks.")


def new_groups(rank_lists: list[list[int]]):
    """Create every group on every rank in the same order; returns the one this rank belongs to."""
    mine = None
    for ranks in rank_lists:
        group = dist.new_group(ranks)
        if dist.get_rank() in ranks:
            mine = group
    return mine


def init_distributed(parallel_cfg) -> DistEnv:
    world = dist.get_world_size()
    check_layout(parallel_cfg, world)
    if world == 1:
        return DistEnv()
    strategy = fleet.DistributedStrategy()
    strategy.hybrid_configs = {"dp_degree": world, "mp_degree": 1, "pp_degree": 1, "sharding_degree": 1}
    on_cpu = paddle.device.get_device() == "cpu"  # the launcher then uses gloo
    with cpu_fallbacks.private_group_rendezvous() if on_cpu else contextlib.nullcontext():
        fleet.init(is_collective=True, strategy=strategy)
        env = DistEnv(rank=dist.get_rank(), world_size=world, hcg=fleet.get_hybrid_communicate_group())
        ep = parallel_cfg.expert_parallel_degree
        if ep > 1:
            env.ep_group = new_groups([list(range(s, s + ep)) for s in range(0, world, ep)])
            if world > ep:
                env.expert_replica_group = new_groups([list(range(i, world, ep)) for i in range(ep)])
    return env


def wrap_model(model, env: DistEnv):
    """fleet's data-parallel wrapper, when gradients are plainly averaged over more than one rank.

    With expert groups the trainer averages the shared parameters itself (fleet's fused all-reduce) and
    leaves expert gradients to the expert groups; fleet refuses to wrap on one rank.
    """
    return fleet.distributed_model(model) if env.world_size > 1 and env.ep_group is None else model
