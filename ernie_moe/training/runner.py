"""How a built model turns a step's micro-batches into gradients and held-out batches into scores.

One runner per run, chosen when the run is built: :class:`PlainRunner` calls the model (wrapped by fleet's
data-parallel wrapper in a pure data-parallel layout), :class:`PipelineRunner` drives fleet's 1F1B (or
interleaved) schedule over this rank's stages. Nothing outside this module asks whether there is a pipeline.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools

import numpy as np
import paddle
import paddle.distributed as dist
from paddle.distributed import fleet

from ..batch import IGNORE_INDEX
from ..config.schema import ModelConfig, TrainingConfig
from ..data import collate
from ..evaluation.token_scores import SCORE_SIZE, batch_scores, eval_metrics, evaluate
from ..model.ernie_vl import ErnieMoEForConditionalGeneration
from ..model.parameter_kinds import is_expert
from ..moe.replay import replayed
from ..nn.param_spec import describe
from ..objectives import LanguageModelling, Objective
from ..objectives.base import REFERENCE_LOGPS
from ..objectives.sums import step_sums, weighted_loss
from ..parallel import build_plan
from ..parallel.env import DistEnv
from ..parallel.grad_sync import GradSync
from ..parallel.pipeline import ErniePipeline, TrainedModel, time_schedule_parts
from ..timing import part
from .preference import PrecomputedReference, ReferenceModel


def build_model(model_cfg: ModelConfig, env: DistEnv, loss_chunk: int = 0, objective: Objective | None = None):
    """The single-device model, or this rank's pipeline stages; expert weights that differ between ranks
    are marked so that fleet's parameter broadcasts leave them alone. ``loss_chunk``: tokens per chunk of
    the LM head and loss (``training.loss_subbatch_seqlen``); ``objective``: what the loss is (default:
    language modelling)."""
    plan = build_plan(model_cfg, env)
    model: ErniePipeline | ErnieMoEForConditionalGeneration
    if env.pp_group is not None:
        model = ErniePipeline(model_cfg, plan, env, env.virtual_stages, objective or LanguageModelling(), loss_chunk)
    else:
        model = ErnieMoEForConditionalGeneration(model_cfg, plan, loss_chunk, objective)
    if env.expert_group is not None:
        for name, param in model.named_parameters():
            if is_expert(name):
                describe(param, local_to_rank=True)
    return model


def build_runner(model: TrainedModel, env: DistEnv, precision, grad_sync: GradSync, timed: bool,
                 reference: ReferenceModel | PrecomputedReference | None = None) -> PlainRunner | PipelineRunner:
    """The runner for ``model`` as :func:`build_model` built it for this layout; ``timed``: the step's time is
    broken down (``logging.time_breakdown``); ``reference``: the reference of an objective that has one."""
    runner = PipelineRunner if env.pp_group is not None else PlainRunner
    return runner(model, env, precision, grad_sync, timed, reference)


class PlainRunner:
    """The whole model on every rank of a stage: a forward and a backward per micro-batch."""

    # whether the micro-batch shape is fixed once the run is built (the memory guard cannot halve it)
    fixed_micro_batches = False

    def __init__(self, model: TrainedModel, env: DistEnv, precision, grad_sync: GradSync, timed: bool, reference=None):
        self.model, self.env, self.precision, self.grad_sync = model, env, precision, grad_sync
        self.reference = reference

    def forward_backward(self, micro_batches, scale: float | paddle.Tensor,
                         during_backward=contextlib.nullcontext) -> paddle.Tensor:
        """Accumulate gradients of ``loss_sum x scale[0] + MTP loss sums x scale[1:] + router loss / micro-batches``
        (``scale``: the loss weights, ``[1 + MTP depths]`` on the device: the data ranks over each loss's
        denominator, the MTP depths' times their lambda / depths); returns this rank's sums over its micro-batches,
        on the device: ``[loss, router losses, the objective's figures, the MTP depths' loss sums]``.
        ``during_backward``: a context for each backward pass (the data feed reads ahead there)."""
        self.reference_pass(micro_batches)  # the objective's reference, before the policy's pass
        sums = []
        for i, batch in enumerate(micro_batches):
            with replayed(self.model, [batch.routes]):  # the sampled routing, in the backward's recompute too
                with part("forward"), self.precision.autocast():
                    out = self.model(batch)
                loss = weighted_loss(out.loss_sum, out.mtp_sums, scale) + out.router_loss / len(micro_batches)
                if i == len(micro_batches) - 1:  # the backward that ends the step syncs as it goes
                    self.grad_sync.expect_backward([loss])
                with part("backward"), during_backward():  # overlap_grad_sync: the gradient all-reduce too
                    self.precision.scale(loss).backward()
                self.grad_sync.after_backward()
            sums.append(step_sums(out.loss_sum, out.router_loss, out.figures, out.mtp_sums))
        return paddle.add_n(sums) if len(sums) > 1 else sums[0]

    @property
    def objective(self) -> Objective:
        return self.model.objective

    def reference_pass(self, micro_batches) -> None:
        """The reference figures of each batch, into the batches (an objective with a reference: the reference
        model's pass, or the figures computed before the run, ``training.preference``)."""
        if self.reference is not None:
            with part("reference"):
                self.reference.fill(self, micro_batches)

    @paddle.no_grad()
    def logps_pass(self, micro_batches) -> None:
        """What the objective's reference pass keeps of each batch (a preference pair's answers'
        log-probabilities) under the weights the model holds now, in evaluation mode, into
        ``batch.objective_inputs[REFERENCE_LOGPS]``."""
        self.model.eval()
        try:
            with self.precision.autocast():
                for batch in micro_batches:
                    batch.objective_inputs[REFERENCE_LOGPS] = self.model(batch, reference_pass=True).figures
        finally:
            self.model.train()

    def micro_batch_groups(self, batches, training_cfg: TrainingConfig):
        """Row batches as the groups of micro-batches one pass takes (here: one micro-batch at a time)."""
        for rows in batches:
            yield [collate(rows)]

    def finish_gradients(self) -> None:
        """What the backward passes left of the step's gradient synchronisation."""
        self.grad_sync.finish()

    def evaluate(self, batches, training_cfg: TrainingConfig) -> dict:
        if self.objective.evaluates_figures:
            return self.evaluate_figures(batches, training_cfg)
        with self.precision.autocast():
            return evaluate(self.model, batches, self.env, training_cfg.max_eval_batches)

    @paddle.no_grad()
    def evaluate_figures(self, batches, training_cfg: TrainingConfig) -> dict:
        """The objective's metrics of held-out data (for DPO ``eval_loss``, ``eval_reward_accuracy``, ...): a
        reference pass and a policy pass per group of micro-batches."""
        t = training_cfg
        if t.max_eval_batches:
            batches = itertools.islice(batches, t.max_eval_batches)
        totals = np.zeros(len(self.objective.figures))
        for micro in self.micro_batch_groups(batches, t):
            self.reference_pass(micro)
            totals += self._figures_of(micro)
        totals = self.env.all_reduce_sum(paddle.to_tensor(totals), self.env.data_group).numpy()
        return self.objective.metrics(totals, "eval_")

    def _figures_of(self, micro_batches) -> np.ndarray:
        """The policy's figures of the micro-batches, summed over their rows, in evaluation mode."""
        self.model.eval()
        try:
            with self.precision.autocast():
                return sum(self.model(batch).figures.sum(axis=0).numpy() for batch in micro_batches)
        finally:
            self.model.train()

    def eval_rows_per_device(self, training_cfg: TrainingConfig) -> int:
        return training_cfg.per_device_eval_batch_size

    def sum_over_stages(self, tensor: paddle.Tensor) -> paddle.Tensor:
        return tensor

    def gather_stages(self, value) -> list:
        """Every stage's ``value``, in stage order."""
        return [value]

    def copies_of_other_stages(self) -> list:
        """Parameters that another stage owns (left out of gradient norms)."""
        return []


class PipelineRunner(PlainRunner):
    """This rank's stages of fleet's pipeline schedule; the last stage computes the loss."""

    fixed_micro_batches = True  # fleet's schedule keeps the tensor shapes of its first step

    def __init__(self, model: TrainedModel, env: DistEnv, precision, grad_sync: GradSync, timed: bool, reference=None):
        self.model, self.env, self.precision, self.grad_sync = model, env, precision, grad_sync
        self.reference = reference
        self.fleet_model = fleet.distributed_model(model)
        # After each schedule fleet broadcasts the last stage's loss, which the other stages read back to learn
        # its dtype; the runner sums the loss itself (the loss's sums, over the stages), so that is skipped.
        self.fleet_model._broadcast_final_loss = lambda *args, **kwargs: None
        if timed:
            time_schedule_parts(self.fleet_model)

    def forward_backward(self, micro_batches, scale, during_backward=contextlib.nullcontext) -> paddle.Tensor:
        """What fleet's ``train_batch`` runs before its optimizer step; the sums come from the last stage. Its
        schedule mixes forward and backward passes: ``during_backward`` holds for all of it."""
        self.reference_pass(micro_batches)  # the objective's reference, before the policy's pass
        loss = self.model.loss
        loss.reset()
        # fleet divides each micro-batch's loss by their number: the scale undoes it
        scale = scale * len(micro_batches)
        if self.env.virtual_stages > 1:
            self.fleet_model.set_virtual_pipeline_rank(0)
        scaler = self.precision if self.precision.loss_scale != 1.0 else None  # fleet calls .scale()
        # forward, backward, send/receive and bubble time themselves (time_schedule_parts); the rest is the schedule's
        # the schedule runs each stage's forwards (and their recomputes) in micro-batch order: a sampled routing
        # is imposed on them in that order
        with part("pipeline_schedule"), self.precision.autocast(), during_backward(), \
                replayed(self.model, [b.routes for b in micro_batches]):
            self.fleet_model.forward_backward_pipeline(self.model.stage_inputs(micro_batches, scale=scale),
                                                         scaler)
        return self.sum_over_stages(self._last_stage_sums())

    def _last_stage_sums(self) -> paddle.Tensor:
        """The loss's sums (:meth:`PlainRunner.forward_backward`), zeros on the other stages."""
        loss = self.model.loss
        if loss.sums is not None:
            return loss.sums
        return paddle.zeros([2 + len(self.objective.figures) + self.model.mtp_depths], dtype="float64")

    @paddle.no_grad()
    def logps_pass(self, micro_batches) -> None:
        """The reference pass through fleet's schedule, forward only: the last stage keeps each micro-batch's
        figures (its loss reads them back in the training pass); the other stages' batches get None."""
        loss, schedule = self.model.loss, self.fleet_model
        loss.references, loss.collect_reference = [], True
        schedule.eval()
        try:
            with self.precision.autocast():
                if self.env.virtual_stages > 1:
                    schedule.set_virtual_pipeline_rank(0)
                schedule.eval_batch(self.model.stage_inputs(micro_batches, scale=1.0), compute_loss=True)
        finally:
            schedule.train()
            loss.collect_reference = False
        for batch, logps in zip(micro_batches, loss.references or [None] * len(micro_batches)):
            if logps is not None:  # a stage before the last has none
                batch.objective_inputs[REFERENCE_LOGPS] = logps

    @paddle.no_grad()
    def evaluate(self, batches, training_cfg: TrainingConfig) -> dict:
        """Forward only through fleet's schedule; the last stage's loss function scores each batch. The
        schedule takes ``gradient_accumulation_steps`` micro-batches of the training shape at a time: short
        batches and the last group are filled with unlabelled copies."""
        if self.objective.evaluates_figures:
            return self.evaluate_figures(batches, training_cfg)
        t, schedule, loss = training_cfg, self.fleet_model, self.model.loss
        steps, rows_per_batch = t.gradient_accumulation_steps, t.per_device_train_batch_size
        loss.reset()
        schedule.eval()  # the schedule then skips its shape checks on outputs that carry no gradient
        group: list = []

        def run(group):
            micro, scored = _filled(group, rows_per_batch)
            schedule.eval_batch(self.model.stage_inputs(micro, scored, scale=1.0), compute_loss=True)

        with self.precision.autocast():
            for i, rows in enumerate(batches):
                if t.max_eval_batches and i >= t.max_eval_batches:
                    break
                group.append(rows)
                if len(group) == steps:
                    run(group)
                    group = []
            if group:
                run(group + [None] * (steps - len(group)))
        schedule.train()
        scores = [batch_scores(*evaluated) for evaluated in loss.evaluated]
        loss.reset()
        totals = paddle.to_tensor(np.sum(scores, axis=0) if scores else np.zeros(SCORE_SIZE))
        totals = self.sum_over_stages(totals)
        return eval_metrics(self.env.all_reduce_sum(totals, self.env.data_group).numpy())

    def micro_batch_groups(self, batches, training_cfg: TrainingConfig):
        """Row batches as the schedule takes them: ``gradient_accumulation_steps`` micro-batches of the training
        shape at a time, a short last group filled with unlabelled copies (which add nothing to the objective's
        figures)."""
        t, group = training_cfg, []
        for rows in batches:
            group.append(rows)
            if len(group) == t.gradient_accumulation_steps:
                yield _filled(group, t.per_device_train_batch_size)[0]
                group = []
        if group:
            yield _filled(group + [None] * (t.gradient_accumulation_steps - len(group)),
                          t.per_device_train_batch_size)[0]

    def _figures_of(self, micro_batches) -> np.ndarray:
        """The policy's figures through fleet's schedule, forward only (the last stage's, on every stage)."""
        loss, schedule = self.model.loss, self.fleet_model
        loss.reset()
        schedule.eval()
        try:
            with self.precision.autocast():
                schedule.eval_batch(self.model.stage_inputs(micro_batches, scale=1.0), compute_loss=True)
        finally:
            schedule.train()
        totals = self.sum_over_stages(self._last_stage_sums())[2:].numpy()
        loss.reset()
        return totals

    def eval_rows_per_device(self, training_cfg: TrainingConfig) -> int:
        return training_cfg.per_device_train_batch_size  # the schedule's shape

    def sum_over_stages(self, tensor: paddle.Tensor) -> paddle.Tensor:
        return self.env.all_reduce_sum(tensor, self.env.pp_group)

    def gather_stages(self, value) -> list:
        gathered: list = []
        assert self.env.pp_group is not None  # a pipeline's runner
        dist.all_gather_object(gathered, value, group=self.env.pp_group)
        return gathered

    def copies_of_other_stages(self) -> list:
        return self.model.tied_copies()


def _filled(group: list, rows_per_batch: int) -> tuple[list, list]:
    """Collated evaluation batches of ``rows_per_batch`` rows and their caption categories. Missing rows
    (a short batch, a None entry) are filled with unlabelled copies, which add nothing to the scores."""
    last = [rows for rows in group if rows][-1]
    micro, scored = [], []
    for rows in group:
        keep = len(rows) if rows else 0
        rows = rows or last
        rows = rows + [rows[-1]] * (rows_per_batch - len(rows))
        batch = collate(rows)
        labels, category = batch.labels.numpy(), np.stack([r.scored for r in rows])
        labels[keep:], category[keep:] = IGNORE_INDEX, 0
        micro.append(dataclasses.replace(batch, labels=paddle.to_tensor(labels), counts=None))  # counted anew
        scored.append(paddle.to_tensor(category))
    return micro, scored
