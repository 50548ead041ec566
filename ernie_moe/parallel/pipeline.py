"""Pipeline parallelism: the model's own ordered blocks (``model.blocks``) as fleet's ``PipelineLayer``, run
by fleet's 1F1B schedule (interleaved with ``virtual_pp_degree`` > 1).

fleet builds on each rank only its stages' blocks, cut at decoder layers. With tied embeddings the head
shares the token embedding's matrix through fleet's ``SharedLayerDesc`` (its gradient is summed between
the first and last stage). Weights are drawn by stable name after fleet has built this rank's stages, so
every stage starts as in the single-device model.
"""

from __future__ import annotations

import paddle
from paddle import nn
from paddle.distributed.fleet.meta_parallel import LayerDesc, PipelineLayer, SharedLayerDesc

from ..model.blocks import (
    FinalNorm,
    ImageFeatures,
    LMHead,
    TokenEmbedding,
    block_inputs,
    is_block,
    ordered_blocks,
    stable_names_of,
    tied_head,
)
from ..model.decoder import DecoderLayer
from ..model.ernie_vl import BlockQueries, step_sums, token_losses
from ..nn.init import init_weights
from ..nn.preference import LOGPS, PreferenceLoss
from ..timing import part


class PipelineLoss(nn.Layer):
    """Last stage: ``lm_loss_sum x scale + router losses`` per micro-batch (fleet divides by the number of
    micro-batches; ``scale`` carries the token-count denominator times that number). Keeps the step's sums
    for the logs and, in evaluation (labels with caption categories), each batch's predictions.

    With ``preference`` (labels with the pair sides and the reference log-probabilities) the loss is the pairs'
    and their figures are summed; in the reference pass (``collect_reference``) each batch's log-probabilities are
    kept for the training pass instead."""

    def __init__(self, plan, preference: PreferenceLoss | None = None, chunk: int = 0):
        super().__init__()
        self.plan, self.preference = plan, preference
        self.chunk = chunk  # tokens per chunk of the head and loss: the stage then passes the hidden states on
        self.head = None  # with chunks, the last stage's head: hidden states -> logits (set once it is built)
        self.collect_reference = False
        self.reset()

    def reset(self) -> None:
        self.sums = None  # the step's [loss, router losses, preference figures], on the device
        self.evaluated, self.references = [], []

    def _add(self, *sums) -> None:
        summed = step_sums(*sums)
        self.sums = summed if self.sums is None else self.sums + summed

    def forward(self, outputs, labels):
        final, router_loss = outputs  # the logits, or with chunks the final hidden states
        label_ids, scale = labels[0], labels[1]
        if self.preference is not None:
            return self._pairs(final, router_loss, *labels)
        evaluating = len(labels) > 2  # what the runner scores: predictions need the whole logits
        if self.chunk and not evaluating:
            lm_sum = self._token_losses(final, label_ids).sum()
        else:
            logits = self.head(final) if self.chunk else final
            lm_sum = self.plan.cross_entropy_sum(logits, label_ids)
        self._add(lm_sum, router_loss)
        if evaluating:
            self.evaluated.append((self.plan.predict(logits), label_ids, labels[2].numpy(), float(lm_sum)))
        return lm_sum * scale.sum() + router_loss.sum()

    def _token_losses(self, final, label_ids):
        head = self.head if self.chunk else (lambda logits: logits)
        return token_losses(self.plan, head, final, label_ids, self.chunk, self.training and not final.stop_gradient)

    def _pairs(self, final, router_loss, label_ids, scale, sides, reference):
        loss_sum, figures = self.preference(self._token_losses(final, label_ids), label_ids, sides,
                                            None if self.collect_reference else reference)
        if self.collect_reference:
            self.references.append(figures[:, LOGPS])
            return loss_sum
        self._add(loss_sum, router_loss, figures.detach().sum(axis=0))
        return loss_sum * scale.sum() + router_loss.sum()


class ErniePipeline(BlockQueries, PipelineLayer):
    """This rank's pipeline stages of the model's blocks."""

    def __init__(self, cfg, plan, env, virtual_stages: int, preference: PreferenceLoss | None = None,
                 loss_chunk: int = 0):
        self.cfg, self.plan = cfg, plan
        seed = int(paddle.randint(0, 2**31 - 1, [1]))  # drawn before fleet reseeds per layer
        descs = []
        for block in ordered_blocks(cfg, plan):
            if block.layer is TokenEmbedding and cfg.tie_word_embeddings:
                head = tied_head(plan, passes_hidden=bool(loss_chunk)) if block.tied else None
                descs.append(SharedLayerDesc("embed", TokenEmbedding, head, "weight", **block.kwargs))
            else:
                descs.append(LayerDesc(block.layer, *block.args, **block.kwargs))
        super().__init__(layers=descs, topology=env.hcg.topology(),
                         loss_fn=PipelineLoss(plan, preference, loss_chunk), seg_method="layer:DecoderLayer",
                         num_virtual_pipeline_stages=virtual_stages if virtual_stages > 1 else None)
        self.first_stage = env.hcg.get_stage_id() == 0
        if loss_chunk:
            self._hand_the_head_to_the_loss()
        init_weights(self.stable_named_parameters(include_tied_copy=True), seed)

    def _hand_the_head_to_the_loss(self) -> None:
        """With the loss over chunks, the last stage's head passes the hidden states on and the loss applies it."""
        heads = [b for b in self.blocks() if isinstance(b, LMHead)]
        for block in heads:
            block.passes_hidden = True
        if heads:
            linear = heads[0].lm_head
            self.loss.head = lambda hidden: linear(hidden)  # a function: the loss registers no second copy
        elif self._tied_copy():  # the last stage's copy of the tied embedding
            embedding = self._tied_copy()[0]
            self.loss.head = lambda hidden: self.plan.tied_head(hidden, embedding.weight)

    @property
    def loss(self) -> PipelineLoss:
        return self._loss_fn[0]

    @property
    def preference(self) -> PreferenceLoss | None:
        return self.loss.preference

    def forward(self, input, chunk_id=None):
        output = super().forward(input, chunk_id)
        if self.loss.collect_reference and isinstance(output, tuple):
            # fleet sends the shapes of the tensors that carry a gradient once, with the first activation sent,
            # and checks the training steps against them: the reference pass (without gradients) comes first, so
            # its floating-point outputs are marked as a training step's are (leaves: no graph is kept)
            for tensor in output:
                if isinstance(tensor, paddle.Tensor) and tensor.dtype in (paddle.float32, paddle.float16,
                                                                           paddle.bfloat16):
                    tensor.stop_gradient = False
        return output

    def blocks(self) -> list[nn.Layer]:
        return sorted((layer for layer in self.sublayers() if is_block(layer)), key=_order)

    def stable_named_parameters(self, include_tied_copy: bool = False):
        """The last stage's copy of a tied embedding is left out (it is the first stage's), unless
        ``include_tied_copy``."""
        return stable_names_of([b for b in self.blocks() if include_tied_copy or b not in self._tied_copy()])

    def tied_copies(self) -> list:
        """Parameters that are another stage's (the last stage's copy of a tied embedding)."""
        return [p for block in self._tied_copy() for p in block.parameters()]

    def _tied_copy(self) -> list:
        if self.first_stage or not self.cfg.tie_word_embeddings:
            return []
        return [b for b in self.blocks() if isinstance(b, TokenEmbedding)]


_POSITION = {TokenEmbedding: 0, ImageFeatures: 1, DecoderLayer: 2, FinalNorm: 3, LMHead: 4}


def _order(block) -> tuple:
    return _POSITION[type(block)], getattr(block, "layer_idx", 0)


def stage_inputs(micro_batches, scored=None, scale: float | paddle.Tensor = 1.0) -> list:
    """``[inputs, labels]`` for fleet's schedule: every field a list with one tensor per micro-batch.
    ``scored``: each evaluation batch's caption categories, kept with its predictions by the loss. Pair batches
    add their sides and reference log-probabilities (zeros before the reference pass has filled them)."""
    inputs = tuple(list(field) for field in zip(*(block_inputs(b) for b in micro_batches)))
    if isinstance(scale, paddle.Tensor):
        scale = scale.astype("float32").reshape([1])
    else:
        scale = paddle.full([1], scale, dtype="float32")
    labels = ([b.labels for b in micro_batches], [scale] * len(micro_batches))
    if micro_batches[0].pair_sides is not None:
        references = [b.reference_logps if b.reference_logps is not None
                      else paddle.zeros([b.labels.shape[0], 2], dtype="float32") for b in micro_batches]
        return [inputs, labels + ([b.pair_sides for b in micro_batches], references)]
    return [inputs, labels + ((scored,) if scored is not None else ())]


# The private parts of fleet's PipelineParallel that the timing wraps. A Paddle release may rename them: the
# check below names what is missing (tests/test_time_breakdown.py runs it on the installed fleet).
FLEET_STEP_METHODS = ("_forward_step", "_backward_step")
FLEET_P2P_HELPER = "_p2p_helper"


def missing_schedule_parts(schedule) -> list[str]:
    """What the timing needs of fleet's schedule (an instance, or the class with ``helper_class``) and
    ``schedule`` lacks, by name."""
    missing = [f"PipelineParallel.{m}" for m in FLEET_STEP_METHODS if not callable(getattr(schedule, m, None))]
    helper = getattr(schedule, FLEET_P2P_HELPER, None)
    if helper is None:
        return [*missing, f"PipelineParallel.{FLEET_P2P_HELPER}"]
    helper_class = helper if isinstance(helper, type) else type(helper)
    if not any(n.startswith(("send_", "recv_")) for n in dir(helper_class)):
        missing.append(f"{helper_class.__name__}.send_* / recv_*")
    return missing


def time_schedule_parts(schedule) -> None:
    """Time the parts of fleet's schedule on this rank (``schedule``: fleet's ``PipelineParallel``).

    The stage's forward and backward steps count as ``forward`` and ``backward``. A receive is the wait for a
    neighbour's activation or gradient with nothing else to run: ``pipeline_bubble`` (the schedule's fill
    and drain, any imbalance between stages, and the arrival of the tensor itself). Sends, and the
    interleaved schedule's combined send-and-receive calls, are ``pipeline_send_recv``. A fleet without the
    parts it wraps raises, naming them.
    """
    missing = missing_schedule_parts(schedule)
    if missing:
        raise RuntimeError(f"the step-time breakdown times fleet's pipeline schedule through {', '.join(missing)}, "
                           f"which this Paddle ({paddle.__version__}) does not have; set "
                           "logging.time_breakdown=false to train without it")
    schedule._forward_step = _timed(schedule._forward_step, "forward")
    schedule._backward_step = _timed(schedule._backward_step, "backward")
    helper = getattr(schedule, FLEET_P2P_HELPER)
    for name in dir(type(helper)):
        if name.startswith(("send_", "recv_")):
            kind = "pipeline_bubble" if name.startswith("recv_") else "pipeline_send_recv"
            setattr(helper, name, _timed(getattr(helper, name), kind))


def _timed(method, name: str):
    def timed(*args, **kwargs):
        with part(name):
            return method(*args, **kwargs)
    return timed
