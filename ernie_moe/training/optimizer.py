"""AdamW with ERNIE's parameter groups, and global-norm gradient clipping that reports the norm."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import paddle
from paddle import _C_ops

from ..checkpoint.checkpoint import adam_parts
from ..config.schema import TrainingConfig
from ..finetune import learning_rate_ratios
from ..model.parameter_kinds import is_expert
from ..nn.param_spec import spec_of
from ..parallel.env import DistEnv
from ..parallel.pipeline import TrainedModel
from ..parallel.replicas import owners
from ..parallel.zero import ShardSet, send_owned, stage_of
from .offload import OffloadedOptimizer, buckets, state_bytes_per_parameter
from .schedule import WarmupDecay


def no_decay(name: str, param) -> bool:
    """Norm weights, biases and other vectors are not decayed."""
    return len(param.shape) < 2 or name.endswith(".bias")


def build_optimizer(model: TrainedModel, training_cfg: TrainingConfig, env: DistEnv | None = None,
                    shards: list[ShardSet] | None = None):
    """AdamW over every trainable parameter. With optimizer sharding (stage 1) the non-expert parameters'
    states are split over the sharding ranks by fleet's sharding optimizer, and the routed experts' states
    over the ranks that hold the same experts (:class:`ShardedAdamW`): different ranks hold different
    experts, so expert weights are never broadcast across the sharding group. At stage 2 and 3 ``shards``
    (``parallel.zero.shard_sets``) say who owns what, for the gradients as for the states. With
    ``training.offload_optim`` the states wait in host memory between steps (``training.offload``)."""
    t = training_cfg
    params = [(n, p) for n, p in model.named_parameters() if not p.stop_gradient]
    ratios = learning_rate_ratios(model, t)
    for _, param in params:
        param.optimize_attr["learning_rate"] = ratios.get(id(param), 1.0)
    decayed = {p.name for n, p in params if not no_decay(n, p)}
    scheduler = WarmupDecay(t)
    multi_precision = (t.bf16 or t.fp16) and t.fp16_opt_level == "O2"

    def adamw(parameters):
        return paddle.optimizer.AdamW(
            learning_rate=scheduler,
            parameters=parameters,
            beta1=t.adam_beta1,
            beta2=t.adam_beta2,
            epsilon=t.adam_epsilon,
            weight_decay=t.weight_decay,
            apply_decay_param_fun=lambda name: name in decayed,
            multi_precision=multi_precision,  # float32 master weights for low-precision weights
        )

    def local(parameters):
        """AdamW over parameters whose states this rank keeps whole: offloaded a bucket at a time, or not."""
        if not t.offload_optim:
            return adamw(parameters)
        per_parameter = state_bytes_per_parameter(multi_precision)
        return OffloadedOptimizer([adamw(run) for run in buckets(parameters, per_parameter)])

    if env is None or not env.sharding:
        return local([p for _, p in params]), scheduler
    if stage_of(env) >= 2:
        return _owners_step(local, params, shards or [], stage_of(env) == 2, scheduler), scheduler
    from paddle.distributed.fleet.meta_optimizers.dygraph_optimizer.dygraph_sharding_optimizer import (
        DygraphShardingOptimizer,
    )

    experts = [p for n, p in params if is_expert(n)]
    shared: Any = DygraphShardingOptimizer(adamw([p for n, p in params if not is_expert(n)]), env.hcg)
    if t.offload_optim:  # fleet's sharding optimizer steps its share at once: that share visits whole
        shared = OffloadedOptimizer([shared])
    replicas = env.expert_replica_group
    if not experts:
        return MoEShardingOptimizer(shared, None), scheduler
    if replicas is None or replicas.nranks == 1:
        return MoEShardingOptimizer(shared, local(experts)), scheduler
    owner = owners(replicas.nranks, [p.size for p in experts])
    return MoEShardingOptimizer(shared, ShardedAdamW(local, ShardSet(experts, owner, replicas),
                                                     schedule=scheduler)), scheduler


def _owners_step(local, params: list, shards: list[ShardSet], sends: bool,
                 schedule: WarmupDecay) -> MoEShardingOptimizer:
    """Stage 2 and 3: each shard set's owners step their parameters (and at stage 2 send them to the others);
    routed experts no other rank holds step where they are."""
    sharded = {id(p) for shard in shards for p in shard.params}
    alone = [p for n, p in params if id(p) not in sharded]
    parts = [ShardedAdamW(local, shard, sends, schedule) for shard in shards]
    return MoEShardingOptimizer(*parts, local(alone) if alone else None)


class ShardedAdamW:
    """ZeRO for a set of parameters shared out over a group (``parallel.zero.ShardSet``): each rank keeps the
    AdamW states of the parameters it owns, updates them, and (``sends``) sends their new values to the others.

    Ownership is by size, greedily, in the parameters' order, which is the same on every rank of the group.
    Gradients are already summed onto each owner when ``step`` runs.
    """

    def __init__(self, make_adamw, shard: ShardSet, sends: bool = True, schedule: WarmupDecay | None = None):
        self.shard, self.sends = shard, sends
        self.schedule = schedule  # where the learning rate is read (a rank may own none of the parameters)
        self.params, self.owner = shard.params, shard.owner
        mine = shard.owned()
        self._inner_opt = make_adamw(mine) if mine else None  # ``_inner_opt``: where the checkpoint finds states

    @paddle.no_grad()
    def step(self) -> None:
        if self._inner_opt is not None:
            self._inner_opt.step()
        if self.sends:
            send_owned(self.shard)

    def get_lr(self) -> float:
        if self.schedule is None:
            raise RuntimeError("ShardedAdamW.get_lr needs the schedule it was built with")
        return self.schedule()

    def clear_grad(self) -> None:
        for param in self.params:
            param.clear_gradient()


class MoEShardingOptimizer:
    """Optimizers over disjoint parameters stepped together: fleet's sharding optimizer for the shared parameters
    next to one for the experts, or one per shard set."""

    def __init__(self, *parts):
        self.parts = [o for o in parts if o is not None]

    def step(self) -> None:
        for part in self.parts:
            part.step()

    def clear_grad(self) -> None:
        for part in self.parts:
            part.clear_grad()

    def get_lr(self) -> float:
        return self.parts[0].get_lr()


def optimizer_state_bytes(optimizer) -> int:
    """Bytes of this rank's AdamW states on its device: moments, step powers and float32 master weights
    (on a GPU, states offloaded to host memory do not count)."""
    on_gpu = paddle.device.get_device().startswith("gpu")
    total = 0
    for opt in adam_parts(optimizer):
        tensors = [t for states in opt._accumulators.values() for t in states.values()]
        tensors += list(opt._master_weights.values())
        total += sum(t.size * t.element_size() for t in tensors
                     if not (on_gpu and (t.place.is_cpu_place() or t.place.is_cuda_pinned_place())))
    return total


def split_experts(model: TrainedModel) -> dict[str, list]:
    """Trainable parameters grouped as routed-expert weights and everything else."""
    groups: dict[str, list] = {"expert": [], "non_expert": []}
    for name, param in model.named_parameters():
        if not param.stop_gradient:
            groups["expert" if is_expert(name) else "non_expert"].append(param)
    return groups


@paddle.no_grad()
def gradient_norms(groups: dict[str, list], reduce: dict | None = None, reduce_split=None, reduce_stages=None,
                   uncounted: Sequence = ()) -> dict[str, paddle.Tensor]:
    """The global L2 norm of all gradients (``grad_norm``) and of each group's (``grad_norm_<group>``), as device
    tensors: nothing here waits for the device.

    Each parameter counts once: ``reduce[group]`` sums a group's squared norm over the ranks that hold
    different parts of it (the expert group for expert weights), ``reduce_split`` sums the squares of
    tensor-parallel slices (a record with a ``split``) over the tensor-parallel ranks,
    ``reduce_stages`` over the pipeline stages. ``uncounted`` parameters (a second stage's copy of a tied
    weight) are not counted.
    """
    skip = {id(p) for p in uncounted}
    squares = {}
    for group, params in groups.items():
        params = [p for p in params if id(p) not in skip]
        square = _square_sum([p for p in params if spec_of(p).split is None])
        split = _square_sum([p for p in params if spec_of(p).split is not None])
        if reduce_split is not None:
            split = reduce_split(split.reshape([1])).reshape([])
        square = square + split
        if reduce and group in reduce:
            square = reduce[group](square.reshape([1])).reshape([])
        if reduce_stages is not None:
            square = reduce_stages(square.reshape([1])).reshape([])
        squares[group] = square
    norm = paddle.sqrt(paddle.add_n(list(squares.values())))
    return {"grad_norm": norm, **{f"grad_norm_{g}": paddle.sqrt(s) for g, s in squares.items()}}


@paddle.no_grad()
def clip_gradients(groups: dict[str, list], max_norm: float, grad_norm: float) -> None:
    """Scale every gradient (``uncounted`` copies too) so that the global norm ``grad_norm``, already read, is at
    most ``max_norm`` (0 = no clipping): nothing to do, and no kernel, when it already is."""
    if max_norm <= 0 or grad_norm <= max_norm:
        return
    scale = max_norm / (grad_norm + 1e-6)
    for params in groups.values():
        for p in params:
            if p.grad is not None:
                p.grad.scale_(scale)


def _square_sum(params: list) -> paddle.Tensor:
    """The sum of the squares of the parameters' gradients, in float32: one kernel per gradient."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return paddle.zeros([])
    squares = [_C_ops.squared_l2_norm(g if g.dtype == paddle.float32 else g.astype("float32")) for g in grads]
    return paddle.add_n(squares).reshape([])
