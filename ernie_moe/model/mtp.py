"""ERNIE 4.5's multi-token prediction (MTP): depth k predicts the token k + 1 positions ahead.

Depth k takes the previous depth's hidden states (depth 1: the last decoder layer's, before the final norm) and
the embeddings of the tokens k positions ahead, normalises each (``mtp_hidden_norm``, ``mtp_emb_norm``), projects
their concatenation ``[embeddings, hidden]`` back to the model's width (``mtp_linear_proj``) and runs one dense
decoder layer (``mtp_block``) at the positions of the tokens it embedded; the model's final norm and head give its
logits. The names, the order and the loss (lambda x the mean of the depths' losses) are PaddleFormers'.

In training the block hands on the main hidden states and each depth's stacked along the batch axis (depth after
depth), so that the final norm and the head (on a pipeline's last stage too) treat them as more rows; the loss
splits them again (:func:`split_rows`). Depth k's label at position i is the label at i + k of the same document
(:func:`labels_ahead`): the sequences need no extra tokens, and a document's last k positions train no depth-k
prediction.
"""

from __future__ import annotations

import paddle
from paddle import nn

from ..batch import IGNORE_INDEX
from ..config.schema import ModelConfig
from .decoder import DecoderLayer
from .single_device import SingleDevicePlan


class MultiTokenPrediction(nn.Layer):
    """The MTP depths, between the last decoder layer and the final norm. Input: the decoder layers' tuple with the
    token embeddings carried after it (``model.blocks.ImageFeatures`` carries them when the block is active);
    output ``(hidden, router_loss)``, hidden holding ``1 + depths`` times the rows in training."""

    def __init__(self, cfg: ModelConfig, plan: SingleDevicePlan, attention_inputs):
        super().__init__()
        self.plan = plan
        full = plan.full_sequence()  # the projection sees whole sequences, computed alike on every tensor rank
        depths = range(cfg.num_nextn_predict_layers)
        self.mtp_emb_norm = nn.LayerList([full.norm(cfg.hidden_size, cfg.rms_norm_eps) for _ in depths])
        self.mtp_hidden_norm = nn.LayerList([full.norm(cfg.hidden_size, cfg.rms_norm_eps) for _ in depths])
        self.mtp_linear_proj = nn.LayerList([full.linear(2 * cfg.hidden_size, cfg.hidden_size) for _ in depths])
        # PaddleFormers builds depth k as decoder layer k (config validation keeps those dense); its own attention
        # inputs, as its positions are those of the tokens ahead
        self.mtp_block = nn.LayerList([DecoderLayer(plan, cfg, k, attention_inputs) for k in depths])
        self.active = True  # whether the objective trains it (language modelling); set by the model

    @property
    def depths(self) -> int:
        return len(self.mtp_block)

    def forward(self, inputs):
        hidden, router_loss = inputs[:2]
        if not (self.active and self.mtp_block[0].training):  # evaluation and decoding read the main predictions
            return hidden, router_loss
        token_type_ids, position_ids, key_ends, embeddings = inputs[2:]
        outputs, previous = [hidden], self.plan.gather_sequence(hidden)
        for k in range(1, self.depths + 1):
            x = self.plan.split_sequence(self.projected(k, ahead(embeddings, k), previous))
            x = self.mtp_block[k - 1]((x, router_loss, token_type_ids, ahead(position_ids, k), key_ends))[0]
            outputs.append(x)
            previous = self.plan.gather_sequence(x)
        return paddle.concat(outputs, axis=0), router_loss

    def projected(self, depth: int, embeddings: paddle.Tensor, hidden: paddle.Tensor) -> paddle.Tensor:
        """Depth ``depth``'s input: ``[embeddings, hidden]``, each normalised, projected to the model's width."""
        x = paddle.concat([self.mtp_emb_norm[depth - 1](embeddings), self.mtp_hidden_norm[depth - 1](hidden)], axis=-1)
        return self.mtp_linear_proj[depth - 1](x)

    def decode(self, hidden: paddle.Tensor, embeddings: paddle.Tensor, token_type_ids: paddle.Tensor,
               position_ids: paddle.Tensor, bounds, cache) -> paddle.Tensor:
        """Depth 1 over new positions, their keys and values joining ``cache`` (``generation.speculative``):
        ``hidden`` the last decoder layer's hidden states there, ``embeddings`` those of the tokens one ahead and
        ``position_ids`` their positions; returns the depth's hidden states (before the final norm)."""
        block = self.mtp_block[0]
        x, _ = block.body(self.projected(1, embeddings, hidden), token_type_ids,
                          block.attention_inputs.angles(position_ids), bounds, cache)
        return x


def ahead(x: paddle.Tensor, k: int) -> paddle.Tensor:
    """``x[:, i + k]`` at position i (``[batch, seq, ...]``); the last k positions wrap around to the first, which
    trains nothing: their labels ahead are ignored, and causal attention keeps them from earlier positions."""
    return paddle.roll(x, -k, axis=1)


def labels_ahead(labels: paddle.Tensor, key_ends: paddle.Tensor, depths: int) -> paddle.Tensor:
    """The labels of depths 1..``depths`` stacked along the batch axis ``[depths x batch, seq]``: depth k's label at
    position i is ``labels[i + k]`` when position i + k is in i's document (``key_ends``: each position's
    document end), else IGNORE_INDEX (``batch.HostCounts.labels_ahead`` counts them on the host)."""
    positions = paddle.arange(labels.shape[1], dtype=key_ends.dtype)
    ignored = paddle.full_like(labels, IGNORE_INDEX)
    return paddle.concat([paddle.where(key_ends > positions + k, ahead(labels, k), ignored)
                          for k in range(1, depths + 1)], axis=0)


def split_rows(final: paddle.Tensor, rows: int) -> tuple[paddle.Tensor, paddle.Tensor | None]:
    """(the main rows, the MTP depths' rows or None) of what the final norm or head gave for ``rows`` rows."""
    if final.shape[0] == rows:
        return final, None
    return final[:rows], final[rows:]
