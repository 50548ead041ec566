"""Which ranks hold equal copies of which parameters, and a check that they still do.

Data-parallel ranks (sharding ranks included) hold the same shared parameters; the ranks of an expert replica
group hold the same routed experts. A non-deterministic kernel, a skipped all-reduce or a bad resume makes them
drift apart silently: :func:`compare_replicas` finds that. Each parameter's digest is two sums over the integer
view of its bits, in int64 (wrapping): integer addition does not depend on the order of the reduction, so equal
tensors give equal digests on any device, and a change of one bit changes them.
"""

from __future__ import annotations

from dataclasses import dataclass

import paddle
import paddle.distributed as dist
from paddle.distributed.communication.group import Group

from ..model.parameter_kinds import is_expert
from ..parallel.env import DistEnv

_BITS: dict = {paddle.float32: paddle.int32, paddle.bfloat16: paddle.int16, paddle.float16: paddle.int16,
               paddle.float64: paddle.int64}
_CHUNK = 1 << 22  # elements digested at once: the int64 temporaries stay small whatever the parameter's size


@dataclass
class ReplicaSet:
    """Parameters (by exported name) that every rank of ``group`` holds a copy of."""

    group: Group  # a process group of the layout (paddle.distributed)
    named: list  # [(name, parameter)], the same names in the same order on every rank of the group


def replica_sets(named: list, env: DistEnv) -> list[ReplicaSet]:
    """``named`` (``(name, parameter)`` of this rank) by the group of ranks holding copies of them: the data
    ranks for shared parameters, the expert replicas for routed experts (together when those are the data
    ranks). Empty on one process; a parameter with one copy is in no set."""
    shared = [(n, p) for n, p in named if not is_expert(n)]
    experts = [(n, p) for n, p in named if is_expert(n)]
    sets = []
    data, replicas = env.data_group, env.expert_replica_group
    if replicas is not None and replicas is data:
        shared, experts = shared + experts, []
    if shared and data is not None and data.nranks > 1:
        sets.append(ReplicaSet(data, shared))
    if experts and replicas is not None and replicas.nranks > 1:
        sets.append(ReplicaSet(replicas, experts))
    return sets


def owners(ranks: int, sizes: list[int]) -> list[int]:
    """Which of ``ranks`` ranks (its index in their group) owns each parameter: largest first, each to the least
    loaded rank so far, by ``sizes`` (the parameters' whole sizes, the same on every rank; ties in order), so that
    the shares differ by less than the smallest parameters."""
    loads = [0] * ranks
    owner = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        owner[i] = loads.index(min(loads))
        loads[owner[i]] += sizes[i]
    return owner


def digest(param: paddle.Tensor) -> paddle.Tensor:
    """``[2]`` int64: the sum of the parameter's bits and their sum weighted by position."""
    flat = param.detach().flatten()
    bits = flat.view(_BITS[flat.dtype]) if flat.dtype in _BITS else flat
    total = paddle.zeros([2], dtype="int64")
    for start in range(0, max(flat.shape[0], 1), _CHUNK):
        piece = bits[start: start + _CHUNK].astype("int64")
        weight = paddle.arange(start, start + piece.shape[0], dtype="int64") * 2654435761 + 1
        total = total + paddle.stack([piece.sum(), (piece * weight).sum()])
    return total


@dataclass
class Difference:
    name: str
    rank: int  # the global rank whose copy differs from the group's first
    reference: int  # that first rank
    max_abs_diff: float


@paddle.no_grad()
def compare_replicas(sets: list[ReplicaSet], env: DistEnv) -> list[Difference]:
    """Every copy that differs from the first of its group, over the whole job (every rank gets the same
    list; a collective over the job, every rank calls it)."""
    found = []
    for replica in sets:
        group = replica.group
        mine = paddle.stack([digest(p) for _, p in replica.named])
        gathered: list = []
        dist.all_gather(gathered, mine, group=group)
        unequal = [(g != gathered[0]).any(axis=1) for g in gathered]
        suspects = paddle.nonzero(paddle.stack(unequal).any(axis=0)).flatten().numpy().tolist()
        for i in suspects:  # the few that differ, sent whole to measure by how much
            name, param = replica.named[i]
            copies: list = []
            dist.all_gather(copies, param.detach().astype("float32"), group=group)
            for r, copy in enumerate(copies):
                if group.rank == 0 and bool(unequal[r][i]):  # said once per group
                    found.append(Difference(name, group.ranks[r], group.ranks[0],
                                            float((copy - copies[0]).abs().max())))
    if env.world_size == 1:
        return found
    return [d for rank_found in env.all_gather_object(found) for d in rank_found]


def describe(differences: list[Difference], limit: int = 5) -> str:
    shown = "; ".join(f"{d.name} on rank {d.rank} differs from rank {d.reference} by up to {d.max_abs_diff:.3g}"
                      for d in differences[:limit])
    more = len(differences) - limit
    return shown + (f"; and {more} more" if more > 0 else "")


@paddle.no_grad()
def broadcast_owned(params: list, owner: list[int], group) -> None:
    """Every rank of ``group`` takes each owner's values of the parameters it owns (``owner[i]``: the group
    index owning ``params[i]``): one broadcast per owner, its parameters flattened into one buffer."""
    for rank in range(group.nranks):
        owned = [p for p, o in zip(params, owner) if o == rank]
        if not owned:
            continue
        flat = paddle.concat([p.reshape([-1]) for p in owned])
        dist.broadcast(flat, src=group.ranks[rank], group=group)
        if rank != group.rank:
            for param, piece in zip(owned, paddle.split(flat, [p.size for p in owned])):
                param.set_value(piece.reshape(param.shape))
