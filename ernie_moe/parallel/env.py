"""Process setup through fleet's hybrid topology, in the rank order of ``layout.Layout``.

Expert groups are carved out of the data ranks that share a stage and tensor-parallel rank (``moe_group:
ep``) or are the tensor-parallel group itself (``moe_group: mp``).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any

import paddle
import paddle.distributed as dist
from paddle.distributed import fleet
from paddle.distributed.communication.group import Group

from . import cpu_fallbacks
from .layout import Layout


@dataclass
class DistEnv:
    rank: int = 0
    world_size: int = 1
    hcg: Any = None  # fleet's HybridCommunicateGroup
    data_rank: int = 0  # which share of the global batch this rank reads
    data_world: int = 1  # data-parallel x sharding ranks: shares of the global batch
    data_group: Group | None = None  # ranks with this rank's tensor-parallel place that read other data
    tp_group: Group | None = None  # tensor-parallel ranks (None without tensor parallelism)
    pp_group: Group | None = None  # pipeline stages (None without pipeline parallelism)
    virtual_stages: int = 1
    sequence_parallel: bool = False
    expert_group: Group | None = None  # ranks that split the experts between them
    expert_replica_group: Group | None = None  # ranks holding the same experts (None when there is one copy)
    sharding: str = ""
    stage_lead: int = 0  # the rank that writes this pipeline stage's shared weights (data rank 0, tp rank 0)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def tp_rank(self) -> int:
        return self.tp_group.rank if self.tp_group is not None else 0

    @property
    def pp_rank(self) -> int:
        return self.pp_group.rank if self.pp_group is not None else 0

    @property
    def pp_world(self) -> int:
        return self.pp_group.nranks if self.pp_group is not None else 1

    def all_reduce_sum(self, tensor: paddle.Tensor, group) -> paddle.Tensor:
        """Sum over ``group`` (in place); a no-op without a group (one process, or a degree of 1)."""
        if group is not None and group.nranks > 1:
            dist.all_reduce(tensor, group=group)
        return tensor

    def all_reduce_max(self, tensor: paddle.Tensor) -> paddle.Tensor:
        """The maximum over every rank of the job (in place); a no-op for one process."""
        if self.world_size > 1:
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return tensor

    def all_gather_object(self, value) -> list:
        """Every rank's picklable ``value``, in rank order (sent between the job's own processes only)."""
        if self.world_size == 1:
            return [value]
        gathered: list = []
        dist.all_gather_object(gathered, value)
        return gathered

    def all_gather(self, tensor: paddle.Tensor) -> list[paddle.Tensor]:
        """Every rank's ``tensor``, in rank order."""
        if self.world_size == 1:
            return [tensor]
        gathered: list[paddle.Tensor] = []
        dist.all_gather(gathered, tensor)
        return gathered


def data_degree(parallel_cfg, world_size: int) -> int:
    """Data-parallel ranks: what the other degrees leave of the processes. Raises ConfigError when they do not fit."""
    return Layout.of(parallel_cfg, world_size).check().dp


def check_layout(parallel_cfg, world_size: int) -> None:
    """Degrees that do not fit the launched processes; raises ConfigError before any group is built."""
    Layout.of(parallel_cfg, world_size).check()


def new_groups(rank_lists: list[list[int]]):
    """Create every group on every rank in the same order; returns the one this rank belongs to."""
    mine = None
    for ranks in rank_lists:
        group = dist.new_group(ranks)
        if dist.get_rank() in ranks:
            mine = group
    return mine


def init_distributed(parallel_cfg, training_cfg) -> DistEnv:
    p = parallel_cfg
    world = dist.get_world_size()
    layout = Layout.of(p, world).check()
    on_cpu = paddle.device.get_device() == "cpu"  # the launcher then uses gloo
    if on_cpu:
        cpu_fallbacks.reuse_freed_host_memory()
        cpu_fallbacks.use_avx2_math_on_amd()
    if world == 1:
        return DistEnv()
    dp, tp, sh, pp = layout.dp, layout.tp, layout.sharding, layout.pp
    strategy = fleet.DistributedStrategy()
    hybrid: dict[str, Any] = {"dp_degree": dp, "mp_degree": tp, "pp_degree": pp, "sharding_degree": sh}
    if pp > 1 and on_cpu:
        hybrid["pp_configs"] = cpu_fallbacks.PIPELINE_CONFIGS
    strategy.hybrid_configs = hybrid  # type: ignore[assignment]  # paddle's declared keys lack pp_configs, its setter takes it
    if pp > 1:
        strategy.pipeline_configs = {"accumulate_steps": training_cfg.gradient_accumulation_steps,
                                     "micro_batch_size": training_cfg.per_device_train_batch_size}
        if on_cpu:
            cpu_fallbacks.give_cpu_a_device_id()
    if on_cpu:
        cpu_fallbacks.use_private_group_rendezvous()
    fleet.init(is_collective=True, strategy=strategy)
    hcg = fleet.get_hybrid_communicate_group()
    rank = dist.get_rank()
    env = DistEnv(rank=rank, world_size=world, hcg=hcg, data_world=layout.data_world, sharding=p.sharding,
                  data_rank=hcg.get_data_parallel_rank() * sh + hcg.get_sharding_parallel_rank(),
                  virtual_stages=p.virtual_pp_degree)
    assert rank == layout.rank_of(env.data_rank, hcg.get_stage_id(), hcg.get_model_parallel_rank()), \
        "unexpected fleet rank order"
    env.data_group = new_groups(layout.data_groups())
    env.stage_lead = layout.rank_of(0, hcg.get_stage_id(), 0)
    if pp > 1:
        env.pp_group = hcg.get_pipe_parallel_group()
        if on_cpu:
            cpu_fallbacks.pipeline_pairs(hcg)
    if tp > 1:
        env.tp_group = hcg.get_model_parallel_group()
        env.sequence_parallel = p.sequence_parallel
    if layout.experts_over_tp:
        env.expert_group = env.tp_group
    elif layout.experts_all_to_all:
        env.expert_group = new_groups(layout.expert_groups())
    if env.data_world > 1 and layout.expert_copies == env.data_world:
        env.expert_replica_group = env.data_group  # every data rank holds this rank's experts
    elif layout.expert_copies > 1:
        env.expert_replica_group = new_groups(layout.expert_replica_groups())
    return env


_GLOO = re.compile(r"/gloo/[^\]]*\]\s*(?P<what>.*)", re.S)


def peer_lost(err: BaseException) -> str | None:
    """One line for a collective that lost a peer (gloo's error: a rank died, or answered later than its timeout),
    naming this rank and, where gloo says it, the peer; None for any other error."""
    found = _GLOO.search(str(err)) if isinstance(err, RuntimeError) else None
    if found is None:
        return None
    rank = os.environ.get("PADDLE_TRAINER_ID", "0")
    peer = re.search(r"pair_rank\s*=\s*(\d+)", found["what"])
    who = f"rank {peer[1]}" if peer else "another rank"
    said = " ".join(found["what"].split())[:200]
    return (f"rank {rank} lost a peer: {who} of the job stopped answering (it died, or was slower than the "
            f"collective's timeout): gloo: {said}. The launcher's log folder (workerlog.N) says which rank ended "
            "first and why; an elastic job restarts within --max_restart")
