"""One decoder layer: pre-norm attention, then a dense SwiGLU MLP or the multimodal MoE block."""

from __future__ import annotations

import paddle
from paddle import nn

from ..moe.layer import MoELayer
from ..nn.layers import SwiGLUMLP
from ..nn.recompute import Recomputable
from .attention import Attention
from .single_device import SingleDevicePlan


class DecoderLayer(Recomputable, nn.Layer):
    def __init__(self, plan: SingleDevicePlan, cfg, layer_idx: int, attention_inputs):
        super().__init__()
        self.layer_idx = layer_idx
        self.attention_inputs = attention_inputs  # rotary angles and row bounds, shared by the model's layers
        self.plan, self.cfg = plan, cfg
        self.input_layernorm = plan.norm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(plan, cfg)
        self.post_attention_layernorm = plan.norm(cfg.hidden_size, cfg.rms_norm_eps)
        modalities = cfg.moe_modalities_at(layer_idx)
        self.is_moe = bool(modalities)
        # The MoE block routes whole sequences: under sequence parallelism it gathers them first.
        self.mlp = (MoELayer(plan.full_sequence(), cfg, modalities, layer_idx) if self.is_moe
                    else SwiGLUMLP(plan, cfg.hidden_size, cfg.intermediate_size))

    # body, attention_block, moe_block: the pieces model.recompute.apply_recompute may recompute (Recomputable)
    def forward(self, inputs):
        """``(hidden, router_loss, token_type_ids, position_ids, key_ends, *carried)`` -> the same tuple with the
        new hidden state and the router loss grown by this layer's (see ``model.blocks``)."""
        x, router_loss, token_type_ids, position_ids, key_ends, *carried = inputs
        angles, bounds = self.attention_inputs(position_ids, key_ends)
        x, layer_loss = self.piece("body", x, token_type_ids, angles, bounds)
        return (x, router_loss + layer_loss, token_type_ids, position_ids, key_ends, *carried)

    def body(self, x, token_type_ids, angles, bounds, cache=None) -> tuple[paddle.Tensor, paddle.Tensor]:
        """The new hidden state and this layer's weighted router loss (0 for a dense layer); ``cache``: the
        layer's keys and values of earlier tokens (generation)."""
        x = x + self.piece("attention_block", x, angles, bounds, cache)
        h = self.post_attention_layernorm(x)
        if not self.is_moe:
            return x + self.mlp(h), paddle.zeros([], dtype="float32")
        out, router_loss = self.piece("moe_block", h, token_type_ids)
        return x + out, router_loss

    def attention_block(self, x, angles, bounds, cache=None):
        return self.self_attn(self.input_layernorm(x), angles, bounds, cache)

    def moe_block(self, h, token_type_ids):
        out, router_loss = self.mlp(self.plan.gather_sequence(h), token_type_ids)
        return self.plan.split_sequence(out), router_loss
