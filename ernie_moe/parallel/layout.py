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
    def of(cls, parallel_cfg, world: int | None = None) -> Layout:
        """The layout of ``parallel_cfg`` over ``world`` processes (None: one data-parallel replica's ranks)."""
        p = parallel_cfg
        tp, pp, sharding = p.tensor_parallel_degree, p.pipeline_parallel_degree, p.sharding_parallel_degree
        return cls(world or tp * pp * sharding, tp, pp, sharding, p.expert_parallel_degree, p.moe_group)

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

    @property
    def experts_over_tp(self) -> bool:
        """``moe_group: mp``: the tensor-parallel ranks split the experts (and hold the same tokens)."""
        return self.moe_group == "mp" and self.tp > 1

    @property
    def experts_all_to_all(self) -> bool:
        """``moe_group: ep`` over more than one rank: tokens reach their experts by all-to-all."""
        return self.moe_group == "ep" and self.ep > 1

    @property
    def expert_split(self) -> int:
        """Ranks each modality's experts are split over."""
        return self.tp if self.experts_over_tp else self.ep if self.experts_all_to_all else 1

    @property
    def expert_copies(self) -> int:
        """Ranks of a data group that hold the same experts (their replicas)."""
        return self.data_world if self.experts_over_tp else self.data_world // self.expert_split

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
