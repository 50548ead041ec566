"""A job's layout: the parallel degrees over a number of processes and where each rank sits.

Computed from the ``parallel`` section and the world size, and read by process-group set-up, the memory
planner and the layout search alike. Ranks follow fleet's order (data, pipeline, sharding, tensor; tensor
ranks adjacent): ``rank = ((dp_rank * pp + stage) * sharding + sharding_rank) * tp + tp_rank``.
``data_rank = dp_rank * sharding + sharding_rank`` numbers the ranks that read different data.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Layout:
    world: int
    tp: int = 1
    pp: int = 1
    sharding: int = 1
    ep: int = 1
    moe_group: str = "ep"

    @classmethod
    def of(cls, parallel_cfg, world: int) -> Layout:
        p = parallel_cfg
        return cls(world, p.tensor_parallel_degree, p.pipeline_parallel_degree, p.sharding_parallel_degree,
                   p.expert_parallel_degree, p.moe_group)

    @property
    def model_ranks(self) -> int:
        """Ranks of one data-parallel replica: tensor x pipeline x sharding."""
        return self.tp * self.pp * self.sharding

    @property
    def dp(self) -> int:
        """Data-parallel replicas: what the other degrees leave of the processes."""
        return self.world // self.model_ranks

    @property
    def data_world(self) -> int:
        """Ranks that read different shares of the global batch: data-parallel x sharding."""
        return self.dp * self.sharding

    def check(self) -> Layout:
        """Raises ConfigError when the degrees do not fit the processes; returns the layout."""
        from ..config import ConfigError

        if self.world % self.model_ranks:
            raise ConfigError(
                f"{self.world} processes cannot hold tensor x pipeline x sharding = {self.tp} x {self.pp} x "
                f"{self.sharding} = {self.model_ranks} ranks per data-parallel replica; launch a multiple of "
                f"{self.model_ranks} processes or lower the degrees.")
        if self.moe_group == "ep" and self.data_world % self.ep:
            raise ConfigError(
                f"parallel.expert_parallel_degree ({self.ep}) must divide the data x sharding ranks ({self.dp} x "
                f"{self.sharding}): expert groups are carved out of them. Launch more processes or lower the "
                "degree.")
        return self

    def rank_of(self, data_rank: int, stage: int, tp_rank: int) -> int:
        sh = self.sharding
        return ((data_rank // sh * self.pp + stage) * sh + data_rank % sh) * self.tp + tp_rank

    def data_groups(self) -> list[list[int]]:
        """Per (stage, tensor-parallel rank): the ranks that read different data."""
        return [[self.rank_of(d, s, t) for d in range(self.data_world)] for s in range(self.pp) for t in range(self.tp)]

    def expert_groups(self) -> list[list[int]]:
        """``moe_group: ep``: each data group cut into runs of ``ep`` ranks that split the experts."""
        return [ranks[s: s + self.ep] for ranks in self.data_groups() for s in range(0, len(ranks), self.ep)]

    def expert_replica_groups(self) -> list[list[int]]:
        """``moe_group: ep``: the ranks of a data group that hold the same experts."""
        return [ranks[i::self.ep] for ranks in self.data_groups() for i in range(self.ep)]
