"""Pipeline parallelism: the model's own ordered blocks (``model.blocks``) as fleet's ``PipelineLayer``, run
by fleet's 1F1B schedule (interleaved with ``virtual_pp_degree`` > 1).

fleet builds on each rank only its stages' blocks, cut at decoder layers. With tied embeddings the head
shares the token embedding's matrix through fleet's ``SharedLayerDesc`` (its gradient is summed between
the first and last stage). Weights are drawn by stable name after fleet has built this rank's stages, so
every stage starts as in the single-device model.
"""

from __future__ import annotations

from collections.abc import Callable

import paddle
import paddle.distributed as dist
from paddle import nn
from paddle.distributed.fleet.meta_parallel import LayerDesc, PipelineLayer, SharedLayerDesc

from ..config.schema import ModelConfig
from ..model.blocks import (
    FinalNorm,
    ImageFeatures,
    LMHead,
    TokenEmbedding,
    block_inputs,
    is_block,
    ordered_blocks,
    set_objective,
    stable_names_of,
    tied_head,
)
from ..model.decoder import DecoderLayer
from ..model.ernie_vl import BlockQueries, ErnieMoEForConditionalGeneration
from ..model.mtp import MultiTokenPrediction, labels_ahead, split_rows
from ..model.single_device import SingleDevicePlan
from ..nn.init import init_weights
from ..objectives import Objective, Predictions
from ..objectives.sums import loss_sums, step_sums, weighted_loss
from ..parallel.env import DistEnv
from ..timing import part


class PipelineLoss(nn.Layer):
    """Last stage: the objective's loss x scale + router losses per micro-batch (fleet divides by the number of
    micro-batches; ``scale`` carries the loss's denominator times that number, then the MTP depths' weights). Keeps
    the step's sums for the logs and, in evaluation (labels with caption categories after the objective's inputs),
    each batch's predictions; in a reference pass (``collect_reference``), what the objective keeps of each batch."""

    def __init__(self, plan: SingleDevicePlan, objective: Objective, chunk: int = 0, mtp_depths: int = 0):
        super().__init__()
        self.plan, self.objective = plan, objective
        self.mtp_depths = mtp_depths  # multi-token prediction depths that train: their labels follow the scale
        self.chunk = chunk  # tokens per chunk of the head and loss: the stage then passes the hidden states on
        self.head: Callable | None = None  # with chunks, the last stage's head: hidden states -> logits, once built
        self.collect_reference = False
        self.reset()

    def reset(self) -> None:
        self.sums = None  # the step's [loss, router losses, the objective's figures], on the device
        self.evaluated: list[tuple] = []  # each scored batch's (predictions, labels, categories, loss)
        self.references: list[paddle.Tensor] = []  # what a reference pass keeps of each batch

    def forward(self, outputs, labels):
        final, router_loss = outputs  # the logits, or with chunks the final hidden states
        label_ids, scale, *inputs = labels
        mtp_labels = inputs.pop(0) if self.mtp_depths else None
        taken = len(self.objective.input_names)
        inputs, scored = inputs[:taken], inputs[taken:]  # what the runner scores: predictions need the whole logits
        final, mtp_final = split_rows(final, label_ids.shape[0])
        head = self.head if self.chunk else (lambda logits: logits)
        predictions = Predictions(self.plan, head, final, label_ids, self.chunk,
                                  self.training and not final.stop_gradient, keep_logits=bool(scored))
        if self.collect_reference:
            self.references.append(self.objective.reference(predictions, label_ids, *inputs))
            return router_loss.sum() * 0.0
        loss_sum, figures, mtp_sums = loss_sums(self.objective, predictions, label_ids, inputs, mtp_final, mtp_labels)
        summed = step_sums(loss_sum, router_loss, figures, mtp_sums)
        self.sums = summed if self.sums is None else self.sums + summed
        if scored:
            self.evaluated.append((self.plan.predict(predictions.kept_logits()), label_ids, scored[0].numpy(),
                                   float(loss_sum)))
        return weighted_loss(loss_sum, mtp_sums, scale) + router_loss.sum()


class ErniePipeline(BlockQueries, PipelineLayer):
    """This rank's pipeline stages of the model's blocks."""

    def __init__(self, cfg: ModelConfig, plan: SingleDevicePlan, env: DistEnv, virtual_stages: int,
                 objective: Objective, loss_chunk: int = 0):
        self.cfg, self.plan = cfg, plan
        seed = int(paddle.randint(0, 2**31 - 1, [1]))  # drawn before fleet reseeds per layer
        descs: list[LayerDesc] = []
        self.mtp_depths = objective.mtp_depths(cfg)
        for block in ordered_blocks(cfg, plan):
            if block.layer is TokenEmbedding and cfg.tie_word_embeddings:
                head = tied_head(plan, passes_hidden=bool(loss_chunk)) if block.tied else None
                descs.append(SharedLayerDesc("embed", TokenEmbedding, head, "weight", **block.kwargs))
            else:
                descs.append(LayerDesc(block.layer, *block.args, **block.kwargs))
        super().__init__(layers=descs, topology=env.hcg.topology(),
                         loss_fn=PipelineLoss(plan, objective, loss_chunk, self.mtp_depths),
                         seg_method="layer:DecoderLayer",
                         num_virtual_pipeline_stages=virtual_stages if virtual_stages > 1 else None)
        self.first_stage = env.hcg.get_stage_id() == 0
        self.hcg, self.pp_group = env.hcg, env.pp_group
        set_objective(self.blocks(), cfg, objective)
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

    def stage_inputs(self, micro_batches, scored=None, scale: float | paddle.Tensor = 1.0) -> list:
        """:func:`stage_inputs` for this model's objective and multi-token prediction."""
        return stage_inputs(micro_batches, self.objective, scored, scale, self.mtp_depths)

    @property
    def loss(self) -> PipelineLoss:
        return self._loss_fn[0]

    @property
    def objective(self) -> Objective:
        return self.loss.objective

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

    # decoding over a key/value cache, stage by stage (generation.kv_cache.forward_cached): each stage receives the
    # previous one's hidden states, runs its blocks and sends them on; the last stage's logits of the last new
    # token go to every stage, so that every stage samples the same tokens and decodes in step
    def decoding_input(self, inputs: tuple) -> tuple:
        if self.first_stage:
            return inputs
        ids, token_type_ids, position_ids, key_ends = inputs[:4]
        hidden = paddle.empty([*ids.shape, self.cfg.hidden_size], dtype="float32")
        dist.recv(hidden, src=self._stage_rank(-1), group=self.pp_group)
        return hidden, paddle.zeros([1], dtype="float32"), token_type_ids, position_ids, key_ends

    def decoding_blocks(self) -> list:
        return [b for b in self.run_function if not isinstance(b, MultiTokenPrediction)]

    def decoding_output(self, x: tuple) -> paddle.Tensor:
        stage, stages = self.hcg.get_stage_id(), self.hcg.get_pipe_parallel_world_size()
        if stage < stages - 1:
            dist.send(x[0].astype("float32").contiguous(), dst=self._stage_rank(1), group=self.pp_group)
            vocabulary = self.cfg.vocab_size // self.hcg.get_model_parallel_world_size()  # this tensor rank's slice
            logits = paddle.empty([x[0].shape[0], 1, vocabulary], dtype="float32")
        else:
            hidden = x[0][:, -1:]
            logits = (self.loss.head(hidden) if self.loss.head is not None else hidden).astype("float32").contiguous()
        dist.broadcast(logits, src=self.hcg.get_rank_from_stage(stages - 1), group=self.pp_group)
        return logits

    def _stage_rank(self, step: int) -> int:
        """The global rank of the stage ``step`` after this one (of the same data and tensor ranks)."""
        return self.hcg.get_rank_from_stage(self.hcg.get_stage_id() + step)

    def blocks(self) -> list[nn.Layer]:
        found = [layer for layer in self.sublayers() if is_block(layer)]
        # the multi-token prediction depths' decoder layers are that block's, not blocks of their own
        inner = {id(layer) for b in found if isinstance(b, MultiTokenPrediction) for layer in b.mtp_block}
        return sorted((b for b in found if id(b) not in inner), key=_order)

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


_POSITION = {TokenEmbedding: 0, ImageFeatures: 1, DecoderLayer: 2, MultiTokenPrediction: 3, FinalNorm: 4, LMHead: 5}


def _order(block) -> tuple:
    return _POSITION[type(block)], getattr(block, "layer_idx", 0)


def stage_inputs(micro_batches, objective: Objective, scored=None, scale: float | paddle.Tensor = 1.0,
                 mtp_depths: int = 0) -> list:
    """``[inputs, labels]`` for fleet's schedule: every field a list with one tensor per micro-batch. The labels
    are the label ids, the scale (the loss weights), the MTP depths' labels (``mtp_depths`` > 0), the objective's
    inputs (placeholders for those not filled yet) and, in evaluation, ``scored``: each batch's caption categories,
    kept with its predictions by the loss."""
    inputs = tuple(list(field) for field in zip(*(block_inputs(b) for b in micro_batches)))
    if isinstance(scale, paddle.Tensor):
        scale = scale.astype("float32").reshape([-1])
    else:
        scale = paddle.full([1], scale, dtype="float32")
    labels: tuple[list, ...] = ([b.labels for b in micro_batches], [scale] * len(micro_batches))
    if mtp_depths:
        labels += ([labels_ahead(b.labels, b.key_ends, mtp_depths) for b in micro_batches],)
    loss_inputs = tuple(list(field) for field in zip(*(objective.inputs(b, placeholders=True) for b in micro_batches)))
    return [inputs, labels + loss_inputs + ((scored,) if scored is not None else ())]


# The private parts of fleet's PipelineParallel that the timing wraps. A Paddle release may rename them: the
# check below names what is missing (tests/training/test_time_breakdown.py runs it on the installed fleet).
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


# the model a rank trains: the whole model, or its pipeline stages
TrainedModel = ErnieMoEForConditionalGeneration | ErniePipeline
