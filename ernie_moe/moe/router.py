"""Modality-isolated top-k routing: one float32 router matrix per expert group.

Group 0's matrix is ``weight`` (text), group 1's ``weight_1`` (vision), as in ERNIE. A token is scored
only against its own group's experts; the aux-loss-free correction bias shifts which experts are
*chosen* but not the mixing weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import paddle
import paddle.nn.functional as F
from paddle import nn

from ..nn.init import mark_xavier_uniform
from . import losses


@dataclass
class GroupRouting:
    """Routing of one expert group's tokens (expert ids are local to the group)."""

    token_index: paddle.Tensor  # [n] rows of the flattened hidden state
    expert_ids: paddle.Tensor  # [n, k] local expert ids
    weights: paddle.Tensor  # [n, k] mixing weights (float32)
    probs: paddle.Tensor  # [n, E] router probabilities
    logits: paddle.Tensor  # [n, E]


class Router(nn.Layer):
    def __init__(self, hidden_size: int, expert_counts: list[int], k: int, gate_act: str, renormalize: bool):
        super().__init__()
        self.expert_counts = expert_counts
        self.k = k
        self.gate_act = gate_act
        self.renormalize = renormalize
        for g, n in enumerate(expert_counts):
            param = mark_xavier_uniform(self.create_parameter(
                [hidden_size, n], dtype="float32", default_initializer=nn.initializer.Constant(0.0)))
            self.add_parameter(self.weight_name(g), param)

    @staticmethod
    def weight_name(group: int) -> str:
        return "weight" if group == 0 else f"weight_{group}"

    def weight_of(self, group: int) -> paddle.Tensor:
        return getattr(self, self.weight_name(group))

    def forward(self, x: paddle.Tensor, token_index: paddle.Tensor, group: int,
                correction_bias: paddle.Tensor | None, replay: paddle.Tensor | None = None) -> GroupRouting:
        """``replay [n, k]``: local expert ids imposed where >= 0 (router replay); elsewhere the top-k choice."""
        # The router runs in float32 even under AMP: small logit errors flip top-k choices.
        # token_index lists rows in order, so when it lists them all (a text-only batch) it is every row: no copy
        h = (x if token_index.shape[0] == x.shape[0] else paddle.gather(x, token_index)).astype("float32")
        with paddle.amp.auto_cast(enable=False):
            logits = paddle.matmul(h, self.weight_of(group))
        probs = F.softmax(logits, axis=-1) if self.gate_act == "softmax" else F.sigmoid(logits)
        scores = probs if correction_bias is None else probs + correction_bias
        _, expert_ids = paddle.topk(scores, self.k, axis=-1)
        if replay is not None:
            expert_ids = paddle.where(replay >= 0, replay.astype(expert_ids.dtype), expert_ids)
        weights = paddle.take_along_axis(probs, expert_ids, axis=-1)
        if self.renormalize:
            weights = weights / paddle.clip(weights.sum(axis=-1, keepdim=True), min=1e-12)
        return GroupRouting(token_index, expert_ids, weights, probs, logits)

    def losses(self, routing: GroupRouting | None, group: int, reduce=None) -> dict[str, paddle.Tensor]:
        """The group's router losses. ``reduce`` makes the token statistics global (a collective, so a rank
        without tokens of this group passes ``routing=None`` and still takes part)."""
        if routing is None:
            n = self.expert_counts[group]
            routing = GroupRouting(paddle.zeros([0], "int64"), paddle.zeros([0, self.k], "int64"),
                                   paddle.zeros([0, self.k]), paddle.zeros([0, n]), paddle.zeros([0, n]))
        return {
            "aux_loss": losses.load_balance_loss(routing.probs, routing.expert_ids, reduce),
            "z_loss": losses.z_loss(routing.logits, reduce),
            "orthogonal_loss": losses.orthogonal_loss(self.weight_of(group)),
        }
