"""How a model is assembled for training: every step after the config and the process groups, in one order.

Each step is a small function; the order is the contract, and each step says why it stands where it does.

1. ``build``: the plain model for this rank (the plan's parallel pieces, pipeline stages, expert weights marked
   to stay out of fleet's broadcasts, the objective's loss). Everything after transforms this model in
   place.
2. ``recompute``: which blocks drop their activations. Before the weights and LoRA, which wrap layers inside the
   blocks it routes through fleet's recompute, so the wrappers are part of what is recomputed.
3. ``expert_matmul``: the experts one by one or grouped; it reads weights only when it runs, so it may come here.
4. ``pretrained``: the weights of ``training.model_name_or_path``, into the plain layers, before LoRA puts
   wrappers around them (the stable names are the base's either way).
5. ``fine_tuning``: what trains (LoRA pairs beside chosen layers, frozen parts), after the base weights are in;
   a LoRA run refers to its base by digest.
6. ``quantize``: a LoRA run's frozen base linears to integers and scales (``training.quantize_base``), after
   the pairs, which wrap the layers by their weights, and before the cast, which would cast those weights.
7. ``precision``: the cast to the AMP dtype, after every parameter (LoRA's included) exists.
8. ``shards``: at sharding stage 2 and 3, the owner of each parameter that trains (``parallel.zero``), for its
   gradient, its optimizer states and at stage 3 its weight, once the trainable set is fixed; at stage 3 the
   blocks then gather and release their weights.
9. ``reference``: the objective's reference model (``training.preference``), after the cast: it keeps the
   weights the policy starts from as they will be computed with (at stage 3 those this rank owns), and LoRA's
   adapters, which it switches off.
10. ``grad_sync``: who averages which gradients over which ranks (``parallel.grad_sync``), after the cast, since
    fleet's reducer holds the parameters it syncs and their gradients' dtype.
11. ``runner``: fleet's pipeline schedule where there is one, which takes the model as it now is.
12. ``guard``: the memory guard, which needs to know whether the runner fixes the micro-batch.
13. ``optimizer``: AdamW and the schedule over the parameters that train, once nothing adds any.
14. ``ema``: the moving average of what trains (``training.ema_decay``), last: it copies the weights as they
    now are, cast and final, and shares them out over the replicas the way the layout holds them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..config.schema import Config
from ..finetune import FineTuning, prepare_fine_tuning
from ..finetune.adapter_files import base_reference
from ..finetune.quantize import quantize_base, refuse_a_quantized_base
from ..model.ernie_vl import ErnieMoEForConditionalGeneration
from ..model.recompute import apply_recompute
from ..moe.experts import use_expert_matmul
from ..objectives import Objective, build_objective
from ..parallel import zero
from ..parallel.env import DistEnv
from ..parallel.grad_sync import GradSync
from ..parallel.pipeline import ErniePipeline
from ..parallel.zero import ShardSet
from ..timing import StepTimes
from .ema import WeightAverage
from .memory_guard import MemoryGuard
from .optimizer import build_optimizer, split_experts
from .precision import Precision
from .preference import PrecomputedReference, ReferenceModel
from .runner import PlainRunner, build_model, build_runner


@dataclass
class Assembled:
    model: ErnieMoEForConditionalGeneration | ErniePipeline  # the whole model, or this rank's pipeline stage
    fine_tuning: FineTuning  # what trains
    base: dict | None  # a LoRA run's base model folder and its digest
    precision: Precision
    runner: PlainRunner  # or its pipelined kind
    guard: MemoryGuard
    optimizer: Any  # AdamW, or the sharded and offloaded optimizers wrapping it (their steps are Paddle's)
    scheduler: Any  # the learning-rate schedule (training.schedule)
    param_groups: dict  # parameters by gradient-sync group (experts apart)
    step_times: StepTimes  # where each step's time goes: the run's parts and the collectives' report here
    ema: WeightAverage | None  # the moving average of the weights, when the run keeps one


def assemble(cfg: Config, env: DistEnv, state, device_bytes: float, load_weights) -> Assembled:
    """The model, runner and optimizer of a run, built step by step in the order above. ``state``: the training
    state (its recompute settings); ``load_weights(model, folder)`` loads a pretrained folder."""
    t = cfg.training
    model = build(cfg, env, build_objective(t, env))
    recompute(model, t, state)
    expert_matmul(model, t)
    if t.model_name_or_path:
        load_weights(model, t.model_name_or_path)
    fine_tuning, base = fine_tune(model, cfg, env)
    quantize(model, t, fine_tuning)
    precision = cast(model, t)
    groups = split_experts(model)
    shards = shard_weights(model, groups, env)
    reference = reference_model(model, t)
    owners = zero.GradientOwners(shards, model.blocks(), getattr(model, "weight_shards", None)) if shards else None
    timed = cfg.logging.time_breakdown
    runner = build_runner(model, env, precision, grad_sync(groups, cfg, env, state, owners), timed, reference)
    guard = MemoryGuard(t, env, device_bytes, model, can_halve=not runner.fixed_micro_batches)
    optimizer, scheduler = build_optimizer(model, t, env, shards)
    ema = WeightAverage(t, env, model, shards, zero.stage_of(env) == 3) if t.ema_decay else None
    return Assembled(model, fine_tuning, base, precision, runner, guard, optimizer, scheduler, groups,
                     StepTimes(enabled=timed), ema)


def build(cfg: Config, env: DistEnv, objective: Objective | None = None):
    return build_model(cfg.model, env, cfg.training.loss_subbatch_seqlen, objective)


def reference_model(model, t) -> ReferenceModel | PrecomputedReference | None:
    """The reference of an objective that has one (a precomputed one is filled by the trainer, which has the
    data)."""
    source = model.objective.reference_source
    if source is None:
        return None
    if source == "precomputed":
        return PrecomputedReference()
    shards = getattr(model, "weight_shards", None)  # stage 3: the owners keep the reference, the others gather it
    return ReferenceModel(model, lora=t.fine_tuning == "lora",
                          holds=(lambda p: shards.holds_whole(p)) if shards is not None else (lambda p: True))


def recompute(model, t, state) -> None:
    apply_recompute(model, state.recompute, state.recompute_layers, t.recompute_use_reentrant)


def expert_matmul(model, t) -> None:
    use_expert_matmul(model, t.moe_expert_matmul)


def fine_tune(model, cfg: Config, env: DistEnv):
    """(what trains, the LoRA base's reference or None)."""
    t = cfg.training
    fine_tuning = prepare_fine_tuning(model, t, cfg.model, env)
    base = None
    if t.fine_tuning == "lora":  # every rank refers to the base by the digest rank 0 took
        base = env.all_gather_object(base_reference(t.model_name_or_path) if env.is_main else None)[0]
    return fine_tuning, base


def quantize(model, t, fine_tuning) -> None:
    if t.quantize_base:
        refuse_a_quantized_base(t.model_name_or_path)
        fine_tuning.quantized = (t.quantize_base, quantize_base(model, t.quantize_base, t.quantize_group_size))


def shard_weights(model, groups: dict, env: DistEnv) -> list[ShardSet]:
    """Stage 2 and 3: who owns each trained parameter; at stage 3 the blocks then hold only their owners'."""
    if zero.stage_of(env) < 2:
        return []
    shards = zero.shard_sets(groups, env)
    if zero.stage_of(env) == 3:
        model.weight_shards = zero.WeightShards(shards, model.blocks())
        if model.tied is not None:  # the tied head reads the first block's matrix
            tied, embedding = model.tied, model.blocks()[0]
            model.tied = lambda block, inputs: model.weight_shards.around(embedding, tied, block, inputs)
    return shards


def grad_sync(groups, cfg: Config, env: DistEnv, state, owners: zero.GradientOwners | None) -> GradSync:
    """One pass per backward unless a reentrant recompute is on (read each step: the guard may turn it on)."""
    reentrant = cfg.training.recompute_use_reentrant
    return GradSync(groups, env, cfg.parallel.overlap_grad_sync, one_pass=lambda: not (state.recompute and reentrant),
                    owners=owners)


def cast(model, t) -> Precision:
    precision = Precision(t)
    precision.cast_model(model)
    return precision
