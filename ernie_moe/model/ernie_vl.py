"""The ERNIE-4.5-VL-style multimodal MoE language model, written for one device.

Parameter names follow PaddleFormers' Paddle layout (``model.layers.{i}.self_attn.qkv_proj``,
``model.layers.{i}.mlp.experts.{j}``, ``model.resampler_model``, ``vision_model``, ``lm_head``) so that
checkpoints convert by renaming and transposing.
"""

from __future__ import annotations

import re
from typing import NamedTuple

import numpy as np
import paddle
from paddle import nn

from ..batch import IGNORE_INDEX, Batch
from .attention import causal_document_mask
from .decoder import DecoderLayer
from .init import init_weights, mark_default_rules
from .rope import rope_angles
from .single_device import SingleDevicePlan
from .vision import Adapter, VisionTransformer


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
        angles, allowed = attention_inputs(self.cfg, batch.position_ids, batch.doc_ids)
        x, router_loss = self.plan.split_sequence(embeddings), paddle.zeros([], dtype="float32")
        for layer in self.layers:
            x, layer_loss = layer(x, batch.token_type_ids, angles, allowed)
            router_loss = router_loss + layer_loss
        return self.norm(x), router_loss


class ErnieMoEForConditionalGeneration(nn.Layer):
    def __init__(self, cfg, plan=None):
        super().__init__()
        seed = int(paddle.randint(0, 2**31 - 1, [1]))  # first, so that it does not depend on what gets built
        self.cfg = cfg
        self.plan = plan or SingleDevicePlan(cfg.initializer_range)
        self.vision_model = VisionTransformer(cfg.vision_config)
        self.model = ErnieVLModel(self.plan, cfg)
        if not cfg.tie_word_embeddings:
            self.lm_head = self.plan.column_linear(cfg.hidden_size, cfg.vocab_size)
        mark_default_rules(self.vision_model)
        mark_default_rules(self.model.resampler_model)
        init_weights(self.stable_named_parameters(), seed)

    def moe_layers(self):
        return [layer.mlp for layer in self.model.layers if layer.is_moe]

    def decoder_layers(self):
        return list(self.model.layers)

    def vision_modules(self):
        return [self.vision_model, self.model.resampler_model]

    def stable_named_parameters(self, include_tied_copy: bool = False):
        """(name in the exported model, parameter): routed experts carry their global ids wherever they live.
        ``include_tied_copy`` is for pipeline stages, which may hold another stage's tied weight; one model
        holds no copies."""
        return stable_names(self.named_parameters(), self.moe_layers())

    def embed(self, batch: Batch) -> paddle.Tensor:
        return with_images(self.model.embed_tokens(batch.input_ids), self.vision_model, self.model.resampler_model,
                           self.cfg, batch, self.training)

    def logits(self, hidden: paddle.Tensor) -> paddle.Tensor:
        if self.cfg.tie_word_embeddings:
            return self.plan.tied_head(hidden, self.model.embed_tokens.weight)
        return self.lm_head(hidden)

    def forward(self, batch: Batch, return_logits: bool = False) -> ModelOutput:
        hidden, router_loss = self.model(self.embed(batch), batch)
        logits = self.logits(hidden)
        loss_sum = self.plan.cross_entropy_sum(logits, batch.labels)
        num_label_tokens = int((batch.labels != IGNORE_INDEX).sum())
        return ModelOutput(loss_sum, num_label_tokens, router_loss, logits if return_logits else None)


def attention_inputs(cfg, position_ids: paddle.Tensor, doc_ids: paddle.Tensor):
    """Rotary angles and the packed-document causal mask every decoder layer uses."""
    t_slots = cfg.freq_allocation if cfg.rope_3d else None
    return rope_angles(position_ids, cfg.head_dim, cfg.rope_theta, t_slots), causal_document_mask(doc_ids)


def with_images(embeddings, vision_model, resampler_model, cfg, batch: Batch, training: bool) -> paddle.Tensor:
    """Token embeddings with image features written at the image placeholder positions."""
    slots = paddle.nonzero((batch.input_ids == cfg.im_patch_id).flatten()).flatten()
    if batch.pixel_patches.shape[0] == 0 and slots.shape[0] == 0:
        if not training:
            return embeddings
        # Text-only batch in training: run the vision side on one blank merge block, times 0, so that
        # gradient synchronisation finds a gradient for every parameter on every rank.
        merge = cfg.vision_config.spatial_merge_size
        grid = np.array([[1, merge, merge]])
        blank = paddle.zeros([merge * merge, cfg.vision_config.in_channels * cfg.vision_config.patch_size ** 2],
                             dtype=embeddings.dtype)
        return embeddings + resampler_model(vision_model(blank, grid), grid).sum() * 0.0
    features = resampler_model(vision_model(batch.pixel_patches, batch.grid_thw), batch.grid_thw)
    if features.shape[0] != slots.shape[0]:
        raise ValueError(f"the batch has {slots.shape[0]} image placeholder tokens but its images give "
                         f"{features.shape[0]} features")
    shape = embeddings.shape
    flat = paddle.scatter(embeddings.reshape([-1, shape[-1]]), slots, features.astype(embeddings.dtype))
    return flat.reshape(shape)


def is_expert(name: str) -> bool:
    """A routed expert's parameter (``...mlp.experts.<id>...``), local or stable name."""
    return ".mlp.experts." in name


def is_router(name: str) -> bool:
    """A router weight (``...mlp.gate.weight``, the vision router ``...mlp.gate.weight_1``)."""
    return bool(re.search(r"\.mlp\.gate\.weight(_\d+)?$", name))


def is_vision(name: str) -> bool:
    """A parameter of the ViT or the adapter (stable name)."""
    return name.startswith(("vision_model.", "model.resampler_model."))


def stable_names(named_parameters, moe_layers) -> list[tuple[str, paddle.Tensor]]:
    """Rename ``...mlp.experts.<local index>.`` to the expert's global id."""
    renames = {}
    for moe in moe_layers:
        prefix = f"model.layers.{moe.layer_idx}.mlp.experts."
        renames.update({f"{prefix}{local}.": f"{prefix}{j}." for local, j in enumerate(moe.experts.global_ids)})
    named = []
    for name, param in named_parameters:
        if is_expert(name):
            head, _, tail = name.partition(".mlp.experts.")
            local, _, rest = tail.partition(".")
            name = renames[f"{head}.mlp.experts.{local}."] + rest
        named.append((name, param))
    return named
