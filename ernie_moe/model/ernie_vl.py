"""The ERNIE-4.5-VL-style multimodal MoE language model, written for one device.

It runs its ordered blocks (``model.blocks``) one after another; a pipeline (``parallel.pipeline``) places
the same blocks on its stages. Parameters have stable names in PaddleFormers' Paddle layout
(``model.layers.{i}.self_attn.qkv_proj``, ``model.layers.{i}.mlp.experts.{j}``, ``model.resampler_model``,
``vision_model``, ``lm_head``), so that checkpoints convert by renaming and transposing.
"""

from __future__ import annotations

from typing import NamedTuple

import paddle
from paddle import nn

from ..batch import Batch
from ..config.schema import ModelConfig
from ..nn.init import init_weights
from ..objectives import LanguageModelling, Objective, Predictions
from ..objectives.sums import loss_sums
from .blocks import ImageFeatures, block_inputs, ordered_blocks, set_objective, stable_names_of, tied_head
from .decoder import DecoderLayer
from .mtp import MultiTokenPrediction, labels_ahead, split_rows
from .single_device import SingleDevicePlan


class ModelOutput(NamedTuple):
    """A tuple, so that fleet's data-parallel wrapper finds the output tensors it tracks for backward."""

    loss_sum: paddle.Tensor  # the objective's loss, summed over its units (label tokens, pairs)
    num_label_tokens: int  # the units of the loss (objectives.Objective.loss)
    router_loss: paddle.Tensor  # weighted router losses of every MoE layer, summed
    logits: paddle.Tensor | None = None
    figures: paddle.Tensor | None = None  # the objective's figures of each row (a reference pass: what it keeps)
    mtp_sums: paddle.Tensor | None = None  # [depths]: each multi-token prediction depth's loss, summed (training)


class BlockQueries:
    """What the trainer, the monitor and the checkpoints ask of a model, answered from its blocks; shared
    by the single-device model and a pipeline stage (``blocks()``: this process's blocks, in order)."""

    def blocks(self) -> list[nn.Layer]:
        raise NotImplementedError

    def decoder_layers(self) -> list[DecoderLayer]:
        return [b for b in self.blocks() if isinstance(b, DecoderLayer)]

    def moe_layers(self):
        return [layer.mlp for layer in self.decoder_layers() if layer.is_moe]

    def mtp_layers(self) -> list[nn.Layer]:
        """The multi-token prediction depths' decoder layers (none where another stage holds them)."""
        return [layer for b in self.blocks() if isinstance(b, MultiTokenPrediction) for layer in b.mtp_block]

    def vision_modules(self) -> list[nn.Layer]:
        return [m for b in self.blocks() if isinstance(b, ImageFeatures) for m in (b.vision_model, b.resampler_model)]

    def stable_named_parameters(self, include_tied_copy: bool = False):
        """(name in the exported model, parameter). ``include_tied_copy`` matters to pipeline stages only,
        whose last stage may hold a copy of the first stage's tied embedding."""
        return stable_names_of(self.blocks())


class ErnieMoEForConditionalGeneration(BlockQueries, nn.Layer):
    """The whole model on one device: every block, run in order. The blocks' layers are registered under
    the exported names (``model.layers.3``, ``vision_model``, ...), so that ``named_parameters`` and
    ``state_dict`` read like PaddleFormers'; the wrapping blocks are kept in order beside them."""

    def __init__(self, cfg: ModelConfig, plan: SingleDevicePlan | None = None, loss_chunk: int = 0,
                 objective: Objective | None = None):
        super().__init__()
        seed = int(paddle.randint(0, 2**31 - 1, [1]))  # first, so that it does not depend on what gets built
        self.cfg = cfg
        self.loss_chunk = loss_chunk  # tokens per chunk of the head and loss (0: the whole sequence at once)
        self.objective = objective or LanguageModelling()  # what the loss is (training.stage)
        self.plan = plan or SingleDevicePlan(cfg.initializer_range)
        self.tied = tied_head(self.plan) if cfg.tie_word_embeddings else None
        self._ordered = tuple(spec.build() for spec in ordered_blocks(cfg, self.plan) if not spec.tied)
        set_objective(self._ordered, cfg, self.objective)
        embedding, images, *layers, norm = self._ordered[:-1] if not self.tied else self._ordered
        self.vision_model = images.vision_model
        mtp = {name: getattr(b, name) for b in layers if isinstance(b, MultiTokenPrediction)
               for name in ("mtp_block", "mtp_emb_norm", "mtp_hidden_norm", "mtp_linear_proj")}
        self.model = _Named(embed_tokens=embedding.embed_tokens,
                            layers=nn.LayerList([b for b in layers if isinstance(b, DecoderLayer)]), norm=norm.norm,
                            resampler_model=images.resampler_model, **mtp)
        if not self.tied:
            self.lm_head = self._ordered[-1].lm_head
        init_weights(self.stable_named_parameters(), seed)

    def blocks(self) -> list[nn.Layer]:
        return list(self._ordered)

    def trunk(self) -> list[nn.Layer]:
        """The blocks before the head: their output is ``(final hidden states, router loss)``."""
        return list(self._ordered if self.tied else self._ordered[:-1])

    def forward(self, batch: Batch, return_logits: bool = False, reference_pass: bool = False) -> ModelOutput:
        """The objective's loss of ``batch``; ``return_logits``: with the whole logits; ``reference_pass``: the
        figures are what the objective's reference pass keeps."""
        x = block_inputs(batch)
        for block in self.trunk():
            x = block(x)
        final, router_loss = x
        hidden, mtp_hidden = split_rows(final, batch.input_ids.shape[0])
        predictions = Predictions(self.plan, self.head, hidden, batch.labels, self.loss_chunk,
                                  self.training and not hidden.stop_gradient, keep_logits=return_logits)
        objective, inputs = self.objective, self.objective.inputs(batch)
        units = objective.units(batch.host_counts())
        if reference_pass:
            kept = objective.reference(predictions, batch.labels, *inputs)
            return ModelOutput(paddle.zeros([]), units, router_loss.sum(), figures=kept)
        mtp_labels = None if mtp_hidden is None else labels_ahead(batch.labels, batch.key_ends,
                                                                  self.cfg.num_nextn_predict_layers)
        loss_sum, figures, mtp_sums = loss_sums(objective, predictions, batch.labels, inputs, mtp_hidden, mtp_labels)
        logits = predictions.kept_logits() if return_logits else None
        return ModelOutput(loss_sum, units, router_loss.sum(), logits, figures, mtp_sums)

    def head(self, hidden: paddle.Tensor) -> paddle.Tensor:
        """Logits of the final hidden states (the last block, or the tied embedding's matrix)."""
        logits, _ = self.tied(self._ordered[0], (hidden, None)) if self.tied else self._ordered[-1]((hidden, None))
        return logits

    # decoding over a key/value cache (generation.kv_cache.forward_cached): what new tokens enter, the blocks
    # they pass, and the logits that come out; a pipeline stage answers these for its part
    def decoding_input(self, inputs: tuple) -> tuple:
        return inputs

    def decoding_blocks(self) -> list:
        return [b for b in self.trunk() if not isinstance(b, MultiTokenPrediction)]

    def decoding_output(self, x: tuple) -> paddle.Tensor:
        return self.head(x[0])


class _Named(nn.Layer):
    """Holds layers under the names given."""

    def __init__(self, **layers):
        super().__init__()
        for name, layer in layers.items():
            setattr(self, name, layer)
