"""The model as an ordered list of blocks, each taking and giving the tuple that flows between them.

A block reads the training flag of its inner layers, not its own: on one device the model registers the
inner layers under the exported names and keeps the blocks only in order.

One device builds every block and runs them in order (``ernie_vl``); a pipeline hands the same list to
fleet, which builds a contiguous run of blocks on each stage and sends the tuple between stages (tensors
only, hence a tuple and not the Batch)::

    inputs           (input_ids, token_type_ids, position_ids, key_ends, pixel_patches, grid_thw)
    TokenEmbedding   (embeddings, *inputs)
    ImageFeatures    (hidden, router_loss, token_type_ids, position_ids, key_ends[, embeddings])
    DecoderLayer     the same, the router loss grown by the layer's
    MultiTokenPrediction  (hidden, router_loss); in training with the MTP depths' rows after the batch's (``model.mtp``)
    FinalNorm        (hidden, router_loss)
    LMHead           (logits, router_loss); with tied embeddings the token embedding's matrix, see tied_head
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import paddle
from paddle import nn

from .. import host_reads
from ..batch import Batch
from ..config.schema import ModelConfig
from ..nn.flashmask import RowBounds
from ..nn.init import mark_default_rules
from ..nn.rope import Rotation, rope_angles
from .decoder import DecoderLayer
from .mtp import MultiTokenPrediction
from .single_device import SingleDevicePlan
from .vision import Adapter, VisionTransformer, blank_merge_block


def block_inputs(batch: Batch) -> tuple:
    """The first block's input tuple."""
    # kept on the host: the vision blocks plan their work from it (a pipeline carries it as a tensor)
    grid = paddle.to_tensor(np.asarray(batch.grid_thw, dtype=np.int64).reshape([-1, 3]), place=paddle.CPUPlace())
    return batch.input_ids, batch.token_type_ids, batch.position_ids, batch.key_ends, batch.pixel_patches, grid


class TokenEmbedding(nn.Layer):
    def __init__(self, cfg: ModelConfig, plan: SingleDevicePlan):
        super().__init__()
        self.embed_tokens = plan.embedding(cfg.vocab_size, cfg.hidden_size)

    @property
    def weight(self):
        return self.embed_tokens.weight

    def forward(self, inputs):
        return (self.embed_tokens(inputs[0]),) + tuple(inputs)


class ImageFeatures(nn.Layer):
    """The ViT and the adapter; writes each image's features at its placeholder tokens."""

    def __init__(self, cfg: ModelConfig, plan: SingleDevicePlan):
        super().__init__()
        self.cfg, self.plan = cfg, plan
        self.vision_model = plan.vision_encoder(VisionTransformer(cfg.vision_config))
        self.resampler_model = Adapter(cfg)
        mark_default_rules(self.vision_model)
        mark_default_rules(self.resampler_model)
        self.carries_embeddings = False  # multi-token prediction reads them after the decoder layers (set_objective)

    def forward(self, inputs):
        embeddings, input_ids, token_type_ids, position_ids, key_ends, pixel_patches, grid_thw = inputs
        hidden = self.with_images(embeddings, input_ids, pixel_patches, host_reads.read(grid_thw, "host_inputs"))
        router_loss = paddle.zeros([1], dtype="float32")
        router_loss.stop_gradient = False  # a pipeline sends it between stages with its gradient
        out = self.plan.split_sequence(hidden), router_loss, token_type_ids, position_ids, key_ends
        return out + (hidden,) if self.carries_embeddings else out

    def with_images(self, embeddings, input_ids, pixel_patches, grid_thw: np.ndarray) -> paddle.Tensor:
        cfg = self.cfg
        if pixel_patches.shape[0] == 0:  # no images: im_patch_id may then be a text token (a text model's)
            if not self.vision_model.training:
                return embeddings
            blank, grid = blank_merge_block(cfg.vision_config, embeddings.dtype)  # a text-only batch in training
            return embeddings + self.resampler_model(self.vision_model(blank, grid), grid).sum() * 0.0
        slots = paddle.nonzero((input_ids == cfg.im_patch_id).flatten()).flatten()
        features = self.resampler_model(self.plan.vision_features(self.vision_model, pixel_patches, grid_thw),
                                        grid_thw)
        if features.shape[0] != slots.shape[0]:
            raise ValueError(f"the batch has {slots.shape[0]} image placeholder tokens but its images give "
                             f"{features.shape[0]} features")
        shape = embeddings.shape
        flat = paddle.scatter(embeddings.reshape([-1, shape[-1]]), slots, features.astype(embeddings.dtype))
        return flat.reshape(shape)


class AttentionInputs:
    """Rotary angles and the packed-document causal row bounds, computed once per micro-batch for all the decoder
    layers of a model or stage: the layers receive the same position and document tensors, so the last
    ones seen (held, so that their identity stays theirs) decide whether to compute again."""

    def __init__(self, cfg: ModelConfig):
        self.t_slots = cfg.freq_allocation if cfg.rope_3d else None
        self.head_dim, self.theta = cfg.head_dim, cfg.rope_theta
        self.last: tuple = (None, None, None)

    def __call__(self, position_ids: paddle.Tensor, key_ends: paddle.Tensor):
        seen_positions, seen_ends, value = self.last
        if seen_positions is not position_ids or seen_ends is not key_ends:
            # a copy: a pipeline stage frees its inputs' memory once consumed, and the backward still reads these
            value = self.angles(position_ids), RowBounds(key_ends.clone())
            self.last = (position_ids, key_ends, value)
        return value

    def angles(self, position_ids: paddle.Tensor) -> Rotation:
        return Rotation(rope_angles(position_ids, self.head_dim, self.theta, self.t_slots), interleaved=True)


class FinalNorm(nn.Layer):
    def __init__(self, cfg: ModelConfig, plan: SingleDevicePlan):
        super().__init__()
        self.norm = plan.norm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, inputs):
        return self.norm(inputs[0]), inputs[1]


class LMHead(nn.Layer):
    def __init__(self, cfg: ModelConfig, plan: SingleDevicePlan):
        super().__init__()
        self.lm_head = plan.column_linear(cfg.hidden_size, cfg.vocab_size)
        self.passes_hidden = False  # a pipeline's loss over chunks applies the head itself

    def forward(self, inputs):
        return inputs if self.passes_hidden else (self.lm_head(inputs[0]), inputs[1])


def tied_head(plan: SingleDevicePlan, passes_hidden: bool = False):
    """The head of tied embeddings: ``forward(token embedding block, inputs)``; ``passes_hidden``: the final
    hidden states go on to the loss, which applies the head over chunks."""

    def forward(embedding: TokenEmbedding, inputs):
        return inputs if passes_hidden else (plan.tied_head(inputs[0], embedding.weight), inputs[1])

    return forward


@dataclass
class Block:
    """One entry of the ordered list: the class and its arguments. ``tied``: the head that reuses the token
    embedding's matrix (no parameters of its own)."""

    layer: type
    args: tuple
    kwargs: dict = field(default_factory=dict)
    tied: bool = False

    def build(self) -> nn.Layer:
        return self.layer(*self.args, **self.kwargs)


def ordered_blocks(cfg: ModelConfig, plan: SingleDevicePlan) -> list[Block]:
    attention_inputs = AttentionInputs(cfg)
    pieces = {"cfg": cfg, "plan": plan}
    mtp = [Block(MultiTokenPrediction, (cfg, plan, AttentionInputs(cfg)))] if cfg.num_nextn_predict_layers else []
    return [Block(TokenEmbedding, (), pieces), Block(ImageFeatures, (), pieces),
            *[Block(DecoderLayer, (plan, cfg, i, attention_inputs)) for i in range(cfg.num_hidden_layers)],
            *mtp, Block(FinalNorm, (), pieces),
            Block(TokenEmbedding, (), pieces, tied=True) if cfg.tie_word_embeddings else Block(LMHead, (), pieces)]


def set_objective(blocks, cfg, objective) -> None:
    """Multi-token prediction runs (and the embeddings are carried to it) where the model has it and ``objective``
    trains it."""
    active = objective.mtp_depths(cfg) > 0
    for block in blocks:
        if isinstance(block, ImageFeatures):
            block.carries_embeddings = active
        elif isinstance(block, MultiTokenPrediction):
            block.active = active


# Stable-name prefixes (the exported model's names) of each block's parameters.
_PREFIXES = {TokenEmbedding: {"embed_tokens.": "model.embed_tokens."},
             ImageFeatures: {"vision_model.": "vision_model.", "resampler_model.": "model.resampler_model."},
             MultiTokenPrediction: {f"{part}.": f"model.{part}." for part in ("mtp_block", "mtp_emb_norm",
                                                                          "mtp_hidden_norm", "mtp_linear_proj")},
             FinalNorm: {"norm.": "model.norm."}, LMHead: {"lm_head.": "lm_head."}}


def is_block(layer) -> bool:
    return type(layer) in _PREFIXES or isinstance(layer, DecoderLayer)


def stable_names_of(blocks) -> list[tuple[str, paddle.Tensor]]:
    """(exported name, parameter) of the blocks' parameters; routed experts carry their global ids wherever
    they live (``...mlp.experts.<global id>.``)."""
    named = []
    for block in blocks:
        if isinstance(block, DecoderLayer):
            prefixes = {"": f"model.layers.{block.layer_idx}."}
            renames = block.mlp.experts.global_ids if block.is_moe else []
        else:
            prefixes, renames = _PREFIXES[type(block)], []
        for name, param in block.named_parameters():
            head = next(k for k in prefixes if name.startswith(k))
            name = prefixes[head] + name[len(head):]
            if renames and ".mlp.experts." in name:
                before, _, tail = name.partition(".mlp.experts.")
                local, _, rest = tail.partition(".")
                name = f"{before}.mlp.experts.{renames[int(local)]}.{rest}"
            named.append((name, param))
    return named
