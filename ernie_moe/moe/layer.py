"""The heterogeneous multimodal MoE block: router -> dispatcher -> experts -> combine, plus shared experts."""

from __future__ import annotations

from collections import deque

import paddle
from paddle import nn

from ..config.schema import ModelConfig
from ..nn.layers import SwiGLUMLP
from ..nn.recompute import replaying
from .experts import Experts
from .losses import orthogonal_loss
from .replay import DROPPED, record_of
from .router import Router
from .stats import ExpertStats

TEXT, VISION = 0, 1


class MoEStatics(nn.Layer):
    """Holds ERNIE's ``e_score_correction_bias`` [groups, max experts]: trained by a rule, not by gradients."""

    def __init__(self, groups: int, max_experts: int):
        super().__init__()
        self.e_score_correction_bias = self.create_parameter(
            [groups, max_experts], dtype="float32", default_initializer=nn.initializer.Constant(0.0))
        self.e_score_correction_bias.stop_gradient = True
        self.frozen = False  # a run that freezes the routers keeps the bias too (fine_tuning, training.freeze)


def group_modalities(cfg: ModelConfig, modalities: list[int]) -> list[int | None]:
    """The modality each router group of a layer with experts for ``modalities`` serves: with
    ``moe_use_hard_gate`` and two expert groups, one group per such modality; otherwise one group (None) for every
    token."""
    if cfg.moe_use_hard_gate and len(cfg.moe_num_experts) == 2:
        return [m for m in (TEXT, VISION) if m in modalities]
    return [None]


def router_counts(cfg: ModelConfig, modalities: list[int]) -> list[int]:
    """The experts each router group of such a layer chooses among (the correction bias's rows are these groups)."""
    groups = group_modalities(cfg, modalities)
    return [sum(cfg.moe_num_experts)] if groups == [None] else [cfg.moe_num_experts[m] for m in groups if m is not None]


class MoELayer(nn.Layer):
    """Routes each modality's tokens to its own experts.

    ``modalities`` lists the modalities that have experts in this layer. With ``moe_use_hard_gate`` and two
    expert groups, group m serves modality m (video counts as image); otherwise one group serves every
    token. Tokens of a modality without experts here get only the shared experts.
    """

    def __init__(self, plan, cfg, modalities: list[int], layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        counts, widths = list(cfg.moe_num_experts), list(cfg.moe_intermediate_size)
        self.hard_gate = cfg.moe_use_hard_gate and len(counts) == 2
        self.group_modality = group_modalities(cfg, modalities)
        self.router_counts = router_counts(cfg, modalities)
        if self.hard_gate:
            counts = [counts[m] for m in self.group_modality if m is not None]  # a hard gate's groups: each a modality
            widths = [widths[m] for m in self.group_modality if m is not None]
        self.expert_offsets = [sum(counts[:g]) for g in range(len(counts))] if self.hard_gate else [0]
        self.num_experts = sum(counts)
        self.expert_widths = [w for n, w in zip(counts, widths) for _ in range(n)]  # by global expert id
        self.capacity_factors = list(cfg.moe_capacity)
        self.training_capacity: float | None = None  # a training capacity factor set for a while (memory guard)
        self.loss_weights = [
            {name: cfg.loss_weight(f"moe_{name}_lambda", self._weight_modality(g))
             for name in ("aux_loss", "z_loss", "orthogonal_loss")}
            for g in range(len(self.router_counts))
        ]

        self.gate = Router(cfg.hidden_size, self.router_counts, cfg.moe_k, cfg.moe_gate_act, cfg.moe_norm_gate_logits)
        self.experts = Experts(plan, cfg.hidden_size, counts, widths)
        self.shared_experts = (
            SwiGLUMLP(plan, cfg.hidden_size, cfg.moe_intermediate_size[0] * cfg.moe_num_shared_experts)
            if cfg.moe_num_shared_experts else None
        )
        self.moe_statics = None
        if cfg.moe_use_aux_free:
            self.moe_statics = MoEStatics(len(self.router_counts), max(self.router_counts))
        self.aux_free_coef = cfg.moe_aux_free_update_coef
        self.dispatcher = plan.dispatcher(counts, renormalize_kept=cfg.moe_norm_gate_logits)
        self.reduce_router_stats = plan.router_stats_reduce()
        self.stats = ExpertStats(self.router_counts)
        # router replay (moe.replay): the routing imposed on the forwards to come, in order (and again on their
        # recomputes), and where to record this layer's
        self.routes_in: deque | None = None
        self.routes_recomputed: deque | None = None
        self.routes_out: list[paddle.Tensor] | None = None

    def _weight_modality(self, group: int) -> int:
        modality = self.group_modality[group]
        return TEXT if modality is None else modality

    def forward(self, x: paddle.Tensor, token_type_ids: paddle.Tensor) -> tuple[paddle.Tensor, paddle.Tensor]:
        """``x [batch, seq, hidden]`` -> (output, weighted router loss of this layer)."""
        shape = x.shape
        flat = x.reshape([-1, shape[-1]])
        types = token_type_ids.flatten()
        tokens = [self._tokens_of(types, modality) for modality in self.group_modality]
        routes = self._imposed_routes()
        (token_index, expert_ids, weights), router_loss = self._route(flat, tokens, routes)
        keep = None if routes is None else paddle.gather(routes, token_index) != DROPPED
        # Dispatch even without routed tokens: expert-parallel ranks exchange rows in every layer.
        rows, counts, state = self.dispatcher.dispatch(flat, token_index, expert_ids, weights, self.num_experts,
                                                       None if keep is not None else self._limits(tokens), keep)
        if self.routes_out is not None and not replaying():
            self.routes_out.append(record_of(state.kept_pairs, token_index, expert_ids, flat.shape[0]))
        expert_rows, idle_zero = self.experts(rows, counts)
        out = self.dispatcher.combine(expert_rows, state, flat.shape[0])
        if idle_zero is not None:
            out = out + idle_zero
        if self.training and not replaying():
            self.stats.record_routing(state.routed, state.kept)
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat)
        return out.reshape(shape), router_loss

    def _imposed_routes(self) -> paddle.Tensor | None:
        """This forward's replayed routing ``[tokens, k]`` (moe.replay.replayed), or None."""
        if self.routes_in is None or self.routes_recomputed is None:  # replay sets both
            return None
        if replaying():  # a recompute routes as its forward did
            return self.routes_recomputed.popleft()
        routes = self.routes_in.popleft()
        self.routes_recomputed.append(routes)
        return routes

    def _route(self, flat: paddle.Tensor, tokens: list[paddle.Tensor], routes: paddle.Tensor | None):
        """Each group's tokens through its router: ((token rows, global expert ids, weights) of every routed
        token, the weighted router loss: zero outside training). Losses and statistics are recorded once, not again
        in a recompute."""
        routed = []
        router_loss = paddle.zeros([], dtype="float32")
        # Global router statistics (training only): every rank joins the sums, with or without tokens.
        reduce = self.reduce_router_stats if self.training else None
        for g, token_index in enumerate(tokens):
            if token_index.shape[0] == 0 and reduce is None:
                if self.training:  # the orthogonal loss needs no token; it also keeps this router in the backward
                    weight = self.loss_weights[g]["orthogonal_loss"]
                    router_loss = router_loss + weight * orthogonal_loss(self.gate.weight_of(g))
                continue
            routing = None
            if token_index.shape[0]:
                bias = None
                if self.moe_statics is not None:
                    bias = self.moe_statics.e_score_correction_bias[g, : self.router_counts[g]]
                routing = self.gate(flat, token_index, g, bias, self._replayed(routes, token_index, g))
                offset = self.expert_offsets[g]  # group g's expert ids after the groups before it
                routed.append((token_index, routing.expert_ids + offset if offset else routing.expert_ids,
                               routing.weights))
            if not self.training:  # the losses train the routers: evaluation and decoding only route
                continue
            group_losses = self.gate.losses(routing, g, reduce)
            for name, value in group_losses.items():
                router_loss = router_loss + self.loss_weights[g][name] * value
            if not replaying():
                self.stats.record_losses(g, group_losses)
        if not routed:
            k = self.gate.k
            routed = [(paddle.zeros([0], dtype="int64"), paddle.zeros([0, k], dtype="int64"),
                       paddle.zeros([0, k], dtype="float32"))]
        if len(routed) == 1:
            return routed[0], router_loss
        return tuple(paddle.concat(list(part)) for part in zip(*routed)), router_loss

    def _replayed(self, routes: paddle.Tensor | None, token_index: paddle.Tensor, group: int) -> paddle.Tensor | None:
        """The local expert ids ``routes`` impose on the group's tokens (< 0: the router's own choice)."""
        if routes is None:
            return None
        ids = paddle.gather(routes, token_index)
        return paddle.where(ids >= 0, ids - self.expert_offsets[group], ids)

    def _limits(self, tokens: list[paddle.Tensor]) -> paddle.Tensor | None:
        """The capacities ``[experts]`` where one can drop a choice, else None (dropless): a token chooses an
        expert at most once, so a capacity of its group's token count or more keeps every choice: decoding's few
        tokens, and a factor of at least the expert count, always have one."""
        capacities = self._capacities(tokens)
        if capacities is None:
            return None
        group_tokens = [t.shape[0] for t, n in zip(tokens, self.router_counts) for _ in range(n)]
        if all(c >= n for c, n in zip(capacities, group_tokens)):
            return None
        return paddle.to_tensor(capacities, dtype="int64")

    def _capacities(self, tokens: list[paddle.Tensor]) -> list[int] | None:
        """Each expert's capacity for this batch, or None when dropless. PaddleFormers' rule: a batch with image or
        video tokens gives every expert ``int(factor * all tokens // all experts)``; otherwise each group's experts
        share its own tokens."""
        if not self.capacity_factors and not (self.training and self.training_capacity):
            return None
        if self.group_modality == [TEXT, VISION] and tokens[1].shape[0]:
            total = sum(t.shape[0] for t in tokens)
            return [self._capacity(total, self.num_experts)] * self.num_experts
        return [self._capacity(t.shape[0], n) for t, n in zip(tokens, self.router_counts) for _ in range(n)]

    @staticmethod
    def _tokens_of(types: paddle.Tensor, modality: int | None) -> paddle.Tensor:
        if modality is None:
            mask = types >= 0  # every real token; padding is marked -1
        elif modality == TEXT:
            mask = types == 0
        else:
            mask = types >= 1  # image and video tokens share the vision experts
        return paddle.nonzero(mask).flatten()

    def _capacity(self, num_tokens: int, num_experts: int) -> int:
        """``int(factor * tokens // experts)``, factor by mode: [train, eval, eval with fewer tokens than experts]."""
        if self.training and self.training_capacity:
            factor = self.training_capacity
        elif self.training:
            factor = self.capacity_factors[0]
        else:
            factor = self.capacity_factors[2] if num_tokens < num_experts else self.capacity_factors[1]
        return int(factor * num_tokens // num_experts)

    @paddle.no_grad()
    def update_correction_bias(self, usage: paddle.Tensor) -> None:
        """Aux-loss-free balancing after an optimizer step: ``bias += coef * sign(mean_usage - usage)`` per group.

        ``usage`` is the per-expert token count since the last update, already summed over the ranks that
        saw different tokens.
        """
        if self.moe_statics is None or self.moe_statics.frozen:
            return
        bias = self.moe_statics.e_score_correction_bias
        for g, n in enumerate(self.router_counts):
            offset = self.expert_offsets[g]
            counts = usage[offset: offset + n].astype("float32")
            bias[g, :n] = bias[g, :n] + self.aux_free_coef * paddle.sign(counts.mean() - counts)
