"""The ERNIE-4.5-VL-style multimodal MoE language model, written for one device.

Parameter names follow PaddleFormers' Paddle layout (``model.layers.{i}.self_attn.qkv_proj``,
``model.layers.{i}.mlp.experts.{j}``, ``model.resampler_model``, ``vision_model``, ``lm_head``) so that
checkpoints convert by renaming and transposing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import paddle
from paddle import nn

from ..parallel.plan import SingleDevicePlan
from .attention import causal_document_mask
from .decoder import DecoderLayer
from .rope import rope_angles
from .vision import Adapter, VisionTransformer


@dataclass
class Batch:
    """One micro-batch. ``token_type_ids``: 0 text, 1 image, 2 video, -1 padding."""

    input_ids: paddle.Tensor  # [batch, seq] int64
    labels: paddle.Tensor  # [batch, seq] int64, next token or -100
    token_type_ids: paddle.Tensor  # [batch, seq] int64
    position_ids: paddle.Tensor  # [batch, seq, 3] int64 (t, h, w)
    doc_ids: paddle.Tensor  # [batch, seq] int64, packed document of each position
    pixel_patches: paddle.Tensor  # [patches, channels * patch * patch] float32
    grid_thw: np.ndarray  # [images, 3] patches per image along t, h, w


class ModelOutput(NamedTuple):
    """A tuple, so that fleet's data-parallel wrapper finds the output tensors it tracks for backward."""

    loss_sum: paddle.Tensor  # summed cross-entropy over label tokens
    num_label_tokens: int
    router_loss: paddle.Tensor  # weighted router losses of every MoE layer, summed
    logits: paddle.Tensor | None = None


class ErnieVLModel(nn.Layer):
    def __init__(self, plan, cfg):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = plan.embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.LayerList([DecoderLayer(plan, cfg, i) for i in range(cfg.num_hidden_layers)])
        self.plan = plan
        self.norm = plan.norm(cfg.hidden_size, cfg.rms_norm_eps)
        self.resampler_model = Adapter(cfg)

    def forward(self, embeddings, batch: Batch):
        t_slots = self.cfg.freq_allocation if self.cfg.rope_3d else None
        angles = rope_angles(batch.position_ids, self.cfg.head_dim, self.cfg.rope_theta, t_slots)
        allowed = causal_document_mask(batch.doc_ids)
        x, router_loss = self.plan.split_sequence(embeddings), paddle.zeros([], dtype="float32")
        for layer in self.layers:
            x, layer_loss = layer(x, batch.token_type_ids, angles, allowed)
            router_loss = router_loss + layer_loss
        return self.norm(x), router_loss


class ErnieMoEForConditionalGeneration(nn.Layer):
    def __init__(self, cfg, plan=None):
        super().__init__()
        self.cfg = cfg
        self.plan = plan or SingleDevicePlan(cfg.initializer_range)
        self.vision_model = VisionTransformer(cfg.vision_config)
        self.model = ErnieVLModel(self.plan, cfg)
        if not cfg.tie_word_embeddings:
            self.lm_head = self.plan.column_linear(cfg.hidden_size, cfg.vocab_size)

    def moe_layers(self):
        return [layer.mlp for layer in self.model.layers if layer.is_moe]

    def embed(self, batch: Batch) -> paddle.Tensor:
        """Token embeddings with image features written at the image placeholder positions."""
        embeddings = self.model.embed_tokens(batch.input_ids)
        slots = paddle.nonzero((batch.input_ids == self.cfg.im_patch_id).flatten()).flatten()
        if batch.pixel_patches.shape[0] == 0 and slots.shape[0] == 0:
            return embeddings + self._idle_vision() if self.training else embeddings
        features = self.model.resampler_model(self.vision_model(batch.pixel_patches, batch.grid_thw), batch.grid_thw)
        if features.shape[0] != slots.shape[0]:
            raise ValueError(f"the batch has {slots.shape[0]} image placeholder tokens but its images give "
                             f"{features.shape[0]} features")
        shape = embeddings.shape
        flat = paddle.scatter(embeddings.reshape([-1, shape[-1]]), slots, features.astype(embeddings.dtype))
        return flat.reshape(shape)

    def _idle_vision(self) -> paddle.Tensor:
        """Zero that runs the vision side on one blank merge block, for text-only batches in training.

        Data-parallel gradient synchronisation expects a gradient for every parameter on every rank.
        """
        merge = self.cfg.vision_config.spatial_merge_size
        grid = np.array([[1, merge, merge]])
        patch = self.cfg.vision_config.in_channels * self.cfg.vision_config.patch_size ** 2
        blank = paddle.zeros([merge * merge, patch], dtype=self.model.embed_tokens.weight.dtype)
        return self.model.resampler_model(self.vision_model(blank, grid), grid).sum() * 0.0

    def logits(self, hidden: paddle.Tensor) -> paddle.Tensor:
        if self.cfg.tie_word_embeddings:
            return self.plan.tied_head(hidden, self.model.embed_tokens.weight)
        return self.lm_head(hidden)

    def forward(self, batch: Batch, return_logits: bool = False) -> ModelOutput:
        hidden, router_loss = self.model(self.embed(batch), batch)
        logits = self.logits(hidden)
        loss_sum = self.plan.cross_entropy_sum(logits, batch.labels)
        num_label_tokens = int((batch.labels != -100).sum())
        return ModelOutput(loss_sum, num_label_tokens, router_loss, logits if return_logits else None)
