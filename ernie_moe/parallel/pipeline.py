"""Pipeline parallelism: the model described as fleet's ``PipelineLayer``, run by fleet's 1F1B schedule
(interleaved with ``virtual_pp_degree`` > 1).

The pieces are the single-device model's own layers with tuple-in / tuple-out forwards: the first stage
embeds tokens and images, every decoder layer passes on the hidden state and the running sum of the
router losses (so losses of every stage reach the backward pass and the logs), the last stage applies the
norm, the head and the loss. With tied embeddings the head shares the embedding matrix through fleet's
``SharedLayerDesc`` (its gradient is summed between the first and last stage). Weights are drawn by stable
name after fleet has built this rank's stages, so every stage starts as in the single-device model.
"""

from __future__ import annotations

import numpy as np
import paddle
from paddle import nn
from paddle.distributed.fleet.meta_parallel import LayerDesc, PipelineLayer, SharedLayerDesc

from ..batch import Batch
from ..model.decoder import DecoderLayer
from ..model.ernie_vl import attention_inputs, stable_names, with_images
from ..model.init import init_weights, mark_default_rules
from ..model.vision import Adapter, VisionTransformer


class WordEmbeddingPipe(nn.Layer):
    """The token embedding; with tied embeddings also the head (see :func:`tied_head`)."""

    def __init__(self, cfg, plan):
        super().__init__()
        self.embed_tokens = plan.embedding(cfg.vocab_size, cfg.hidden_size)

    @property
    def weight(self):
        return self.embed_tokens.weight

    def forward(self, inputs):
        return (self.embed_tokens(inputs[0]),) + tuple(inputs)


class VisionPipe(nn.Layer):
    """Writes image features at the placeholders and starts the stage tuple."""

    def __init__(self, cfg, plan):
        super().__init__()
        self.cfg, self.plan = cfg, plan
        self.vision_model = VisionTransformer(cfg.vision_config)
        self.resampler_model = Adapter(cfg)
        mark_default_rules(self.vision_model)
        mark_default_rules(self.resampler_model)

    def forward(self, inputs):
        embeddings, input_ids, token_type_ids, position_ids, doc_ids, pixel_patches, grid_thw = inputs
        batch = Batch(input_ids, None, token_type_ids, position_ids, doc_ids, pixel_patches, grid_thw.numpy())
        hidden = with_images(embeddings, self.vision_model, self.resampler_model, self.cfg, batch, self.training)
        router_loss = paddle.zeros([1], dtype="float32")
        router_loss.stop_gradient = False
        return self.plan.split_sequence(hidden), router_loss, token_type_ids, position_ids, doc_ids


class DecoderLayerPipe(DecoderLayer):
    def forward(self, inputs):
        x, router_loss, token_type_ids, position_ids, doc_ids = inputs
        angles, allowed = attention_inputs(self.cfg, position_ids, doc_ids)
        x, layer_loss = super().forward(x, token_type_ids, angles, allowed)
        return x, router_loss + layer_loss, token_type_ids, position_ids, doc_ids


class NormPipe(nn.Layer):
    def __init__(self, cfg, plan):
        super().__init__()
        self.norm = plan.norm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, inputs):
        return self.norm(inputs[0]), inputs[1]


class HeadPipe(nn.Layer):
    def __init__(self, cfg, plan):
        super().__init__()
        self.lm_head = plan.column_linear(cfg.hidden_size, cfg.vocab_size)

    def forward(self, inputs):
        return self.lm_head(inputs[0]), inputs[1]


def tied_head(plan):
    def forward(shared: WordEmbeddingPipe, inputs):
        return plan.tied_head(inputs[0], shared.weight), inputs[1]

    return forward


class PipelineLoss(nn.Layer):
    """Last stage: ``lm_loss_sum x scale + router losses`` per micro-batch (fleet divides by the number of
    micro-batches; ``scale`` carries the token-count denominator times that number). Keeps the step's sums
    for the logs, and in evaluation the scoring of each batch (``score`` is given by the trainer)."""

    def __init__(self, plan):
        super().__init__()
        self.plan = plan
        self.score = None
        self.reset()

    def reset(self) -> None:
        self.lm_sum, self.router_sum, self.scores = 0.0, 0.0, []

    def forward(self, outputs, labels):
        logits, router_loss = outputs
        label_ids, scale = labels[0], labels[1]
        lm_sum = self.plan.cross_entropy_sum(logits, label_ids)
        self.lm_sum += float(lm_sum)
        self.router_sum += float(router_loss.sum())
        if self.score is not None:  # evaluation
            self.scores.append(self.score(logits, label_ids, labels[2], lm_sum))
        return lm_sum * scale.sum() + router_loss.sum()


# Stable-name prefixes of each piece's parameters in the exported (single-device) model.
_PREFIXES = {WordEmbeddingPipe: {"embed_tokens.": "model.embed_tokens."},
             VisionPipe: {"vision_model.": "vision_model.", "resampler_model.": "model.resampler_model."},
             NormPipe: {"norm.": "model.norm."}, HeadPipe: {"lm_head.": "lm_head."}}


class ErniePipeline(PipelineLayer):
    """This rank's pipeline stages, with what the trainer asks of a model."""

    def __init__(self, cfg, plan, env, virtual_stages: int):
        self.cfg, self.plan = cfg, plan
        seed = int(paddle.randint(0, 2**31 - 1, [1]))  # drawn before fleet reseeds per layer
        descs = []
        if cfg.tie_word_embeddings:
            descs.append(SharedLayerDesc("embed", WordEmbeddingPipe, shared_weight_attr="weight", cfg=cfg, plan=plan))
        else:
            descs.append(LayerDesc(WordEmbeddingPipe, cfg=cfg, plan=plan))
        descs.append(LayerDesc(VisionPipe, cfg=cfg, plan=plan))
        descs += [LayerDesc(DecoderLayerPipe, plan, cfg, i) for i in range(cfg.num_hidden_layers)]
        descs.append(LayerDesc(NormPipe, cfg=cfg, plan=plan))
        if cfg.tie_word_embeddings:
            descs.append(SharedLayerDesc("embed", WordEmbeddingPipe, forward_func=tied_head(plan),
                                         shared_weight_attr="weight", cfg=cfg, plan=plan))
        else:
            descs.append(LayerDesc(HeadPipe, cfg=cfg, plan=plan))
        super().__init__(layers=descs, topology=env.hcg.topology(), loss_fn=PipelineLoss(plan),
                         seg_method="layer:DecoderLayerPipe",
                         num_virtual_pipeline_stages=virtual_stages if virtual_stages > 1 else None)
        self.first_stage = env.hcg.get_stage_id() == 0
        init_weights(self.stable_named_parameters(include_tied_copy=True), seed)

    @property
    def loss(self) -> PipelineLoss:
        return self._loss_fn[0]

    def pieces(self) -> list[nn.Layer]:
        return sorted((layer for layer in self.sublayers() if type(layer) in _PREFIXES or
                       isinstance(layer, DecoderLayerPipe)), key=_order)

    def decoder_layers(self) -> list[DecoderLayerPipe]:
        return [p for p in self.pieces() if isinstance(p, DecoderLayerPipe)]

    def moe_layers(self):
        return [layer.mlp for layer in self.decoder_layers() if layer.is_moe]

    def vision_modules(self) -> list[nn.Layer]:
        return [m for p in self.pieces() if isinstance(p, VisionPipe) for m in (p.vision_model, p.resampler_model)]

    def stable_named_parameters(self, include_tied_copy: bool = False):
        """(exported name, parameter) of this rank's stages. The last stage's copy of a tied embedding is left
        out (it is the first stage's), unless ``include_tied_copy``."""
        named = []
        for piece in self.pieces():
            if isinstance(piece, WordEmbeddingPipe) and not self.first_stage and not include_tied_copy:
                continue
            if isinstance(piece, DecoderLayerPipe):
                prefixes = {"": f"model.layers.{piece.layer_idx}."}
            else:
                prefixes = _PREFIXES[type(piece)]
            for name, param in piece.named_parameters():
                head = next(k for k in prefixes if name.startswith(k))
                named.append((prefixes[head] + name[len(head):], param))
        return stable_names(named, self.moe_layers())

    def tied_copies(self) -> list:
        """Parameters that are another stage's (the last stage's copy of a tied embedding)."""
        if self.first_stage or not self.cfg.tie_word_embeddings:
            return []
        return [p for piece in self.pieces() if isinstance(piece, WordEmbeddingPipe) for p in piece.parameters()]


def _order(piece) -> tuple:
    if isinstance(piece, DecoderLayerPipe):
        return (2, piece.layer_idx)
    return ({WordEmbeddingPipe: 0, VisionPipe: 1, NormPipe: 3, HeadPipe: 4}[type(piece)], 0)


def stage_inputs(micro_batches, scored=None, scale: float = 1.0) -> list:
    """``[inputs, labels]`` for fleet's schedule: every field a list with one tensor per micro-batch.
    ``scored``: each evaluation batch's caption categories, for the scoring in the loss function."""
    inputs = tuple([getattr(b, f) for b in micro_batches] for f in
                   ("input_ids", "token_type_ids", "position_ids", "doc_ids", "pixel_patches"))
    grids = [paddle.to_tensor(np.asarray(b.grid_thw, dtype=np.int64).reshape([-1, 3])) for b in micro_batches]
    labels = ([b.labels for b in micro_batches], [paddle.full([1], scale, dtype="float32") for _ in micro_batches])
    return [inputs + (grids,), labels + ((scored,) if scored is not None else ())]
