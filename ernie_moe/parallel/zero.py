"""Sharding stages 2 and 3 (``parallel.sharding``): gradients, and then weights, split over the ranks that share
the optimizer states, by whole parameters.

Each trained parameter has one owner among the ranks holding copies of it (:func:`shard_sets`): the sharding ranks
for dense and shared-expert weights, the ranks holding the same routed experts (their replicas) for those. The owner
keeps the parameter's AdamW states (as in stage 1), and:

- stage 2: its gradient. During the backward each block's gradients are summed onto their owners as soon as the
  block's last one is complete (:class:`GradientOwners`), in place, and the other ranks release theirs; the
  owner's next backward adds to the sum, so accumulation holds no whole gradient between micro-batches. The
  owners' sums are added over the data-parallel copies and scaled once, when the step's last backward is done.
  After the update each owner sends its new weights to the others.
- stage 3: its weight too. The other ranks release it; each block of the model (:class:`WeightShards`) gathers its
  weights from their owners when it runs forward (the next block's gather started as it starts), releases them
  after, gathers them again before its backward and releases each as soon as its gradient is complete. Outside
  the step :func:`held` gathers what is read past the blocks (a decoder layer as generation runs it, a weight as a
  save writes it), and :func:`whole_weights` every weight (the replica check, a resume, an adapter's save).

The collectives are a reduce and a broadcast per parameter, in place (no bucket is copied), on NCCL and on gloo
alike.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

import paddle
import paddle.distributed as dist
from paddle import nn
from paddle.autograd import PyLayer
from paddle.distributed.communication.group import Group

from ..nn.param_spec import full_shape
from ..timing import part
from .env import DistEnv
from .pipeline import TrainedModel
from .replicas import owners

STAGES = {"stage2": 2, "stage3": 3}


def stage_number(sharding: str) -> int:
    """The stage ``parallel.sharding`` names: 0 without sharding, 1, 2 or 3."""
    return STAGES.get(sharding, 1 if sharding else 0)


def stage_of(env: DistEnv) -> int:
    """The sharding stage of this job."""
    return stage_number(env.sharding)


@dataclass
class ShardSet:
    """Parameters shared out over ``group`` (``owner[i]``: the group index owning ``params[i]``); ``copies``: the
    ranks holding the same shares (data-parallel replicas), or None."""

    params: list
    owner: list[int]
    group: Group
    copies: Group | None = None

    def owned(self) -> list:
        return [p for p, o in zip(self.params, self.owner) if o == self.group.rank]

    def by_owner(self, params: list | None = None) -> list[tuple[int, list]]:
        """(owner, its parameters among ``params``, in order) for each owner that has some."""
        chosen = None if params is None else {id(p) for p in params}
        result = []
        for rank in range(self.group.nranks):
            mine = [p for p, o in zip(self.params, self.owner) if o == rank and (chosen is None or id(p) in chosen)]
            if mine:
                result.append((rank, mine))
        return result


def _group(group) -> Group | None:
    return group if group is not None and group.nranks > 1 else None


def shard_sets(groups: dict[str, list], env: DistEnv) -> list[ShardSet]:
    """The trained parameters (``groups``: ``expert`` and ``non_expert``) by the ranks that share them out: the
    sharding group for the dense and shared-expert weights (its data-parallel copies beside it), the routed experts'
    replicas for those. Ownership by size (``parallel.replicas.owners``), the same on every rank."""
    sets = []
    sharding = _group(env.hcg.get_sharding_parallel_group()) if env.hcg is not None else None
    copies = _group(env.hcg.get_data_parallel_group()) if env.hcg is not None else None
    for params, group, extra in ((groups["non_expert"], sharding, copies),
                                 (groups["expert"], _group(env.expert_replica_group), None)):
        if params and group is not None:
            sizes = [math.prod(full_shape(p)) for p in params]
            sets.append(ShardSet(params, owners(group.nranks, sizes), group, extra))
    return sets


def _reduce(shard: ShardSet, params: list) -> None:
    """Sum the gradients of ``params`` (of ``shard``) onto their owners, in place, one parameter at a time (no
    copy of a bucket); the other ranks release theirs. A rank without a gradient for a parameter sends zeros."""
    for rank, owned in shard.by_owner(params):
        for param in owned:
            if param.grad is None:
                param._copy_gradient_from(paddle.zeros(param.shape, param.dtype))
            dist.reduce(param.grad, dst=shard.group.ranks[rank], group=shard.group)
            if rank != shard.group.rank:
                param.clear_gradient(False)


class GradientOwners:
    """Stage 2 and 3: gradients summed onto their owners during the backward, block by block.

    Each block's parameters of a shard set make a bucket; when the last of them has its gradient for this
    backward (the hook Paddle calls after accumulating a leaf's gradient), the bucket's gradients are reduced and
    the other ranks release them. Every rank builds the same graph (every parameter that trains gets a gradient in every
    backward, an idle expert a zero one), so the buckets complete in the same order everywhere. :meth:`flush`
    reduces what a micro-batch's backward left: a bucket of parameters without a gradient, or one a parameter
    came back to after its reduce (a recompute that runs a backward of its own).
    """

    def __init__(self, sets: list[ShardSet], blocks: list[nn.Layer], weights: WeightShards | None = None):
        self.weights = weights  # stage 3: released again once a backward is done, whatever it gathered
        self.buckets: list[tuple[ShardSet, list]] = []
        set_of = {id(p): shard for shard in sets for p in shard.params}
        seen: set[int] = set()
        for holder in [*blocks, None]:  # None: what no block holds
            params = [p for p in (holder.parameters() if holder is not None else [p for s in sets for p in s.params])
                      if id(p) in set_of and id(p) not in seen]
            seen |= {id(p) for p in params}
            for shard in sets:
                mine = [p for p in params if set_of[id(p)] is shard]
                if mine:
                    self.buckets.append((shard, mine))
        self.bucket_of = {id(p): i for i, (_, params) in enumerate(self.buckets) for p in params}
        self._reset()
        for _, params in self.buckets:
            for param in params:
                param._register_backward_hook(functools.partial(self._arrived, param))

    def _reset(self) -> None:
        self.waiting = [{id(p) for p in params} for _, params in self.buckets]
        self.reduced = [False] * len(self.buckets)
        self.again = [False] * len(self.buckets)

    def _arrived(self, param) -> None:
        b = self.bucket_of[id(param)]
        if self.reduced[b]:
            self.again[b] = True
            return
        self.waiting[b].discard(id(param))
        if not self.waiting[b]:
            self._reduce(b)

    @paddle.no_grad()
    def _reduce(self, b: int) -> None:
        with part("gradient_sync"):
            _reduce(*self.buckets[b])
        self.reduced[b] = True

    def flush(self) -> None:
        """After a micro-batch's backward: every bucket reduced once more than its gradients grew."""
        for b in range(len(self.buckets)):
            if not self.reduced[b] or self.again[b]:
                self._reduce(b)
        self._reset()
        if self.weights is not None:
            self.weights.release_all()


@paddle.no_grad()
def finish_owned(sets: list[ShardSet], scale: float) -> None:
    """The step's last reduce done: each owner's sums added over the data-parallel copies and scaled."""
    for shard in sets:
        mine = [p for p in shard.owned() if p.grad is not None]
        if not mine:
            continue
        for param in mine:
            if shard.copies is not None:
                dist.all_reduce(param.grad, group=shard.copies)
            param.grad.scale_(scale)


@paddle.no_grad()
def send_owned(shard: ShardSet, params: list | None = None) -> None:
    """Every rank of the set's group takes its owners' values of ``params`` (all of the set's by default), one
    parameter at a time: into the parameter where it holds one, else into storage of its own."""
    for param, value, _ in _start_sending(shard, params, wait=True):
        if value is not None:
            _fill(param, value)


def _start_sending(shard: ShardSet, params: list | None, wait: bool) -> list[tuple]:
    """The broadcasts of :func:`send_owned`, started (``wait=False``: they may still run when this returns):
    (parameter, the storage it arrives in or None where it arrives in the parameter, the collective's task)."""
    started = []
    for rank, owned in shard.by_owner(params):
        for param in owned:
            value = None if rank == shard.group.rank or param._is_initialized() else \
                paddle.empty(param.shape, dtype=param.dtype)
            task = dist.broadcast(param if value is None else value, src=shard.group.ranks[rank], group=shard.group,
                                  sync_op=wait)
            started.append((param, value, task))
    return started


def _fill(param, value: paddle.Tensor) -> None:
    """Give ``param`` the storage of ``value``, without counting as an in-place change (autograd keeps the
    parameter for its backward and reads what it holds then)."""
    value.contiguous()._share_buffer_to(param)


def _release(param) -> None:
    if param._is_initialized():
        param._clear_data()


class _GatherBeforeBackward(PyLayer):
    """Identity on a block's outputs; its backward, which runs before the block's, gathers the block's weights."""

    @staticmethod
    def forward(ctx, gather, *outputs):
        ctx.gather = gather
        outputs = tuple(x.clone() for x in outputs)  # new tensors: PyLayer refuses to pass its inputs on
        return outputs if len(outputs) > 1 else outputs[0]

    @staticmethod
    def backward(ctx, *grads):
        ctx.gather()
        return grads if len(grads) > 1 else grads[0]


class WeightShards:
    """Stage 3: each rank keeps the weights it owns; the others are gathered for the block that runs.

    ``blocks``: the model's blocks (layers taking and returning a tuple), each gathering the sharded parameters it
    holds, minus any an earlier block holds (the tied embedding's matrix belongs to the first block; the tied head
    gathers it through :meth:`around`).
    """

    def __init__(self, sets: list[ShardSet], blocks: list[nn.Layer]):
        self.sets = sets
        self.set_of = {id(p): shard for shard in sets for p in shard.params}
        self.owned = {id(p) for shard in sets for p in shard.owned()}
        self.pinned = 0  # inside whole_weights: nothing is released
        self.holds: Counter[int] = Counter()  # parameters held (``held``) past the blocks that release them
        self.units: dict[int, list] = {}
        # forward: the next block's gather starts as a block starts; (that block, its broadcasts) until it runs
        self.next_block = {id(a): b for a, b in zip(blocks, blocks[1:])}
        self.prefetched: tuple[int, list] | None = None
        seen: set[int] = set()
        for block in blocks:
            params = [p for p in block.parameters() if id(p) in self.set_of and id(p) not in seen]
            seen |= {id(p) for p in params}
            self.units[id(block)] = params
            block.register_forward_pre_hook(self._before)
            block.register_forward_post_hook(self._after)
        for shard in sets:
            for param in shard.params:
                if id(param) not in self.owned:
                    param._register_backward_hook(self._release_hook(param))

    def holds_whole(self, param) -> bool:
        """Whether this rank keeps ``param`` between its uses (its owner, or a parameter nobody shares out)."""
        return id(param) not in self.set_of or id(param) in self.owned

    def params_of(self, block: nn.Layer) -> list:
        return self.units.get(id(block), [])

    def _release_hook(self, param):
        def hook():  # the gradient is complete: no operation of this backward reads the weight any more
            self.release([param])
        return hook

    def gather(self, params: list) -> None:
        """Every rank of each set takes its owners' values of ``params`` (every rank calls this alike)."""
        self._drop_prefetch()
        if self.pinned or not params:
            return
        with part("weight_gather"):
            for shard in self.sets:
                mine = [p for p in params if self.set_of[id(p)] is shard]
                if mine:
                    send_owned(shard, mine)

    def release(self, params: list) -> None:
        if self.pinned:
            return
        for param in params:
            if id(param) not in self.owned and not self.holds[id(param)]:
                _release(param)

    def release_all(self) -> None:
        self._drop_prefetch()
        self.release([p for shard in self.sets for p in shard.params])

    def _before(self, block, inputs):
        if self.prefetched is not None and self.prefetched[0] == id(block):
            self._finish_prefetch()
        else:
            self.gather(self.params_of(block))
        following = self.next_block.get(id(block))
        if following is not None and paddle.is_grad_enabled() and not self.pinned:
            self._prefetch(following)

    def _prefetch(self, block: nn.Layer) -> None:
        """Start gathering ``block``'s weights, to overlap the block that runs now (NCCL runs them on its own
        stream; gloo's broadcasts complete as they are called)."""
        params = self.params_of(block)
        if not params:
            return
        with part("weight_gather"):
            started = [item for shard in self.sets
                       for item in _start_sending(shard, [p for p in params if self.set_of[id(p)] is shard], False)]
        self.prefetched = (id(block), started)

    def _finish_prefetch(self) -> None:
        assert self.prefetched is not None
        _, started = self.prefetched
        self.prefetched = None
        with part("weight_gather"):
            for param, value, task in started:
                task.wait()
                if value is not None:
                    _fill(param, value)

    def _drop_prefetch(self) -> None:
        """A started gather whose block did not run next: its broadcasts complete (every rank started them), their
        values are not kept."""
        if self.prefetched is not None:
            _, started = self.prefetched
            self.prefetched = None
            for _, _, task in started:
                task.wait()

    def _after(self, block, inputs, outputs):
        return self._wrap(self.params_of(block), outputs)

    def _wrap(self, params: list, outputs):
        """Release ``params`` and have the backward gather them again before it reaches them."""
        if self.pinned or not params:
            return outputs
        self.release(params)
        if not paddle.is_grad_enabled():
            return outputs
        items = list(outputs) if isinstance(outputs, tuple) else [outputs]
        # the outputs the block computed (a leaf passed through carries no gradient into it)
        where = [i for i, x in enumerate(items) if isinstance(x, paddle.Tensor) and not x.stop_gradient
                 and not x.is_leaf and x.dtype in (paddle.float32, paddle.float16, paddle.bfloat16)]
        if not where:
            return outputs
        gather = functools.partial(self.gather, params)  # not a list: PyLayer would look at the tensors in it
        wrapped = _GatherBeforeBackward.apply(gather, *[items[i] for i in where])
        wrapped = wrapped if isinstance(wrapped, (tuple, list)) else [wrapped]
        for i, x in zip(where, wrapped):
            items[i] = x
        return tuple(items) if isinstance(outputs, tuple) else items[0]

    def around(self, block: nn.Layer, run, *args):
        """``run(*args)`` with ``block``'s weights gathered (a head that reuses another block's matrix)."""
        params = self.params_of(block)
        self.gather(params)
        return self._wrap(params, run(*args))

    @contextlib.contextmanager
    def whole(self) -> Iterator[None]:
        """Every weight held by every rank inside (a collective: every rank enters)."""
        if self.pinned:
            yield
            return
        self.gather([p for shard in self.sets for p in shard.params])
        self.pinned += 1
        try:
            yield
        finally:
            self.pinned -= 1
            self.release_all()


def whole_weights(model: TrainedModel) -> contextlib.AbstractContextManager:
    """Inside, every rank holds every weight of ``model`` (a no-op below stage 3)."""
    shards = getattr(model, "weight_shards", None)
    return shards.whole() if shards is not None else contextlib.nullcontext()


@contextlib.contextmanager
def held(model: TrainedModel, what: nn.Layer | list) -> Iterator[None]:
    """Inside, every rank holds the weights of ``what`` (a layer run outside its block's forward, or parameters
    read one by one); a collective below which every rank enters alike, a no-op below stage 3."""
    shards = getattr(model, "weight_shards", None)
    if shards is None:
        yield
        return
    params = [p for p in (what.parameters() if isinstance(what, nn.Layer) else what) if id(p) in shards.set_of]
    shards.gather(params)
    shards.holds.update(id(p) for p in params)
    try:
        yield
    finally:
        shards.holds.subtract(id(p) for p in params)
        shards.release(params)


def norms_over_owners(shards: list[ShardSet], groups: dict[str, list], reduce: dict) -> dict:
    """``reduce`` (a gradient group's name -> how its squared norm is summed over ranks with other parts of it),
    with the sum over each shard set's owners first: at stage 2 and 3 only the owner holds a gradient."""
    reduce = dict(reduce)
    for name, params in groups.items():
        shard = next((s for s in shards if s.params is params), None)
        if shard is None:
            continue
        after = reduce.get(name)

        def summed(x, group=shard.group, after=after):
            dist.all_reduce(x, group=group)
            return after(x) if after is not None else x

        reduce[name] = summed
    return reduce
