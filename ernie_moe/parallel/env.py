"""Process setup through fleet: every launched process is a data-parallel rank in this release."""

from __future__ import annotations

from dataclasses import dataclass

import paddle
import paddle.distributed as dist
from paddle.distributed import fleet


@dataclass
class DistEnv:
    rank: int = 0
    world_size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def all_reduce_sum(self, tensor: paddle.Tensor) -> paddle.Tensor:
        """Sum over ranks (in place); a no-op on one process, where the global group does not exist."""
        if self.world_size > 1:
            dist.all_reduce(tensor)
        return tensor

    def all_gather(self, tensor: paddle.Tensor) -> list[paddle.Tensor]:
        """Every rank's ``tensor``, in rank order."""
        if self.world_size == 1:
            return [tensor]
        gathered: list[paddle.Tensor] = []
        dist.all_gather(gathered, tensor)
        return gathered


def init_distributed(parallel_cfg) -> DistEnv:
    world = dist.get_world_size()
    if world == 1:
        return DistEnv()
    strategy = fleet.DistributedStrategy()
    strategy.hybrid_configs = {"dp_degree": world, "mp_degree": 1, "pp_degree": 1, "sharding_degree": 1}
    fleet.init(is_collective=True, strategy=strategy)
    return DistEnv(rank=dist.get_rank(), world_size=world)


def wrap_model(model, env: DistEnv):
    """fleet's data-parallel wrapper when there is more than one rank (fleet refuses to wrap on one)."""
    return fleet.distributed_model(model) if env.world_size > 1 else model
