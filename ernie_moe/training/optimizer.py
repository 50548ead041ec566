"""AdamW with ERNIE's parameter groups, and global-norm gradient clipping that reports the norm."""

from __future__ import annotations

import paddle

from ..finetune import learning_rate_ratios
from ..model.ernie_vl import is_expert
from .schedule import WarmupDecay


def no_decay(name: str, param) -> bool:
    """Norm weights, biases and other vectors are not decayed."""
    return len(param.shape) < 2 or name.endswith(".bias")


def build_optimizer(model, training_cfg, env=None):
    """AdamW over every trainable parameter; with optimizer sharding (stage 1) the non-expert parameters'
    states are split over the sharding ranks by fleet's sharding optimizer, expert parameters keep a local
    one (different ranks hold different experts: they must never be broadcast across the sharding group)."""
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

    if env is None or not env.sharding:
        return adamw([p for _, p in params]), scheduler
    from paddle.distributed.fleet.meta_optimizers.dygraph_optimizer.dygraph_sharding_optimizer import (
        DygraphShardingOptimizer,
    )

    experts = [p for n, p in params if is_expert(n)]
    shared = DygraphShardingOptimizer(adamw([p for n, p in params if not is_expert(n)]), env.hcg)
    return MoEShardingOptimizer(shared, adamw(experts) if experts else None), scheduler


class MoEShardingOptimizer:
    """fleet's sharding optimizer for the shared parameters next to a local one for the experts."""

    def __init__(self, shared, experts):
        self.parts = [o for o in (shared, experts) if o is not None]

    def step(self) -> None:
        for part in self.parts:
            part.step()

    def clear_grad(self) -> None:
        for part in self.parts:
            part.clear_grad()

    def get_lr(self) -> float:
        return self.parts[0].get_lr()


def split_experts(model) -> dict[str, list]:
    """Trainable parameters grouped as routed-expert weights and everything else."""
    groups: dict[str, list] = {"expert": [], "non_expert": []}
    for name, param in model.named_parameters():
        if not param.stop_gradient:
            groups["expert" if is_expert(name) else "non_expert"].append(param)
    return groups


@paddle.no_grad()
def clip_grad_norm(groups: dict[str, list], max_norm: float, reduce: dict | None = None,
                   reduce_split=None, reduce_stages=None, uncounted: list = ()) -> dict[str, float]:
    """Scale all gradients so their global L2 norm is at most ``max_norm`` (0 = no clipping).

    Each parameter counts once: ``reduce[group]`` sums a group's squared norm over the ranks that hold
    different parts of it (the expert group for expert weights), ``reduce_split`` sums the squares of
    tensor-parallel slices (parameters marked ``is_distributed``) over the tensor-parallel ranks,
    ``reduce_stages`` over the pipeline stages. ``uncounted`` parameters (a second stage's copy of a tied
    weight) are scaled but not counted. Returns ``grad_norm`` (before clipping) and ``grad_norm_<group>``.
    """
    skip = {id(p) for p in uncounted}
    squares = {}
    for group, params in groups.items():
        params = [p for p in params if id(p) not in skip]
        square = _square_sum([p for p in params if not getattr(p, "is_distributed", False)])
        split = _square_sum([p for p in params if getattr(p, "is_distributed", False)])
        if reduce_split is not None:
            split = reduce_split(split.reshape([1])).reshape([])
        square = square + split
        if reduce and group in reduce:
            square = reduce[group](square.reshape([1])).reshape([])
        if reduce_stages is not None:
            square = reduce_stages(square.reshape([1])).reshape([])
        squares[group] = square
    norm = paddle.sqrt(paddle.add_n(list(squares.values())))
    if max_norm > 0:
        scale = paddle.clip(max_norm / (norm + 1e-6), max=1.0)
        for params in list(groups.values()):
            for p in params:
                if p.grad is not None:
                    p.grad.multiply_(scale.astype(p.grad.dtype))
    return {"grad_norm": float(norm), **{f"grad_norm_{g}": float(paddle.sqrt(s)) for g, s in squares.items()}}


def _square_sum(params: list) -> paddle.Tensor:
    grads = [p.grad for p in params if p.grad is not None]
    return paddle.add_n([(g.astype("float32") ** 2).sum() for g in grads]) if grads else paddle.zeros([])
