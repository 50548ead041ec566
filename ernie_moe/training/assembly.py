"""How a model is assembled for training: every step after the config and the process groups, in one order.

Each step is a small function; the order is the contract, and each step says why it stands where it does.

1. ``build``: the plain model for this rank (the plan's parallel pieces, pipeline stages, expert weights marked
   to stay out of fleet's broadcasts, the objective's loss). Everything after transforms this model in
   place.
2. ``recompute``: which blocks drop their activations. Before the weights and LoRA, which wrap layers inside the
   blocks it routes through fleet's recompute, so the wrappers are part of what is recomputed.
3. ``expert_matmul``: the experts one by one or grouped; it reads weights only when it runs, so it may come here.
4. ``pretrained``: the weights of ``training.model_name_or_path``, into the plain layers, before LoRA puts
   wrappers around them (the stable names are the base's either way); the import report said and written.
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
14. ``ema``: the moving average of what trains (``training.ema_decay``): it copies the weights as they now are,
    cast and final, and shares them out over the replicas the way the layout holds them.
15. ``data``: the training feed (the GRPO stage's: rollouts of the policy, which sample with the runner) and the
    held-out set, last: a preference run's precomputed reference is computed from the starting weights now,
    before a resume loads others. The start-up notes and the data report are said here.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..checkpoint.parts import Optimizer, Schedule
from ..checkpoint.pretrained import load_pretrained
from ..config import ConfigError
from ..config.schema import Config
from ..data import build_datasets
from ..data.encoding.tokenizer import Tokenizer
from ..data.feeding.feed import Feed
from ..finetune import FineTuning, prepare_fine_tuning
from ..finetune.adapter_files import base_reference
from ..finetune.quantize import quantize_base, refuse_a_quantized_base
from ..model.parameter_kinds import MTP
from ..model.recompute import apply_recompute
from ..moe.experts import use_expert_matmul
from ..objectives import Objective, build_objective
from ..objectives.rewards import Reward
from ..parallel import zero
from ..parallel.env import DistEnv
from ..parallel.grad_sync import GradSync
from ..parallel.pipeline import TrainedModel
from ..parallel.zero import ShardSet
from ..timing import StepTimes
from .ema import WeightAverage
from .feeds import build_feed
from .memory_guard import MemoryGuard
from .optimizer import build_optimizer, split_experts
from .precision import Precision
from .preference import PrecomputedReference, ReferenceModel
from .runner import PipelineRunner, PlainRunner, build_model, build_runner
from .startup import import_report, notes, report_data
from .state import TrainingState


@dataclass
class Assembled:
    """The run's parts, kept whole: the trainer steps them, the checkpoint saves and restores them
    (``checkpoint.parts.TrainingParts``)."""

    model: TrainedModel  # the whole model, or this rank's pipeline stage
    fine_tuning: FineTuning  # what trains
    base: dict | None  # a LoRA run's base model folder and its digest
    precision: Precision
    runner: PlainRunner | PipelineRunner
    guard: MemoryGuard
    optimizer: Optimizer  # AdamW, or the sharded and offloaded optimizers wrapping it
    scheduler: Schedule  # the learning-rate schedule (training.schedule)
    param_groups: dict  # parameters by gradient-sync group (experts apart)
    step_times: StepTimes  # where each step's time goes: the run's parts and the collectives' report here
    ema: WeightAverage | None  # the moving average of the weights, when the run keeps one
    state: TrainingState  # where the run is and how it steps now
    feed: Feed  # this rank's rows of each step, and the data position
    eval_set: object | None  # the held-out set (samples or pairs), or None
    rewards: Sequence[Reward]  # what sampled and generated answers are scored with
    data_stats: Counter = field(default_factory=Counter)  # skipped and fitted samples, the data/ metrics


def assemble(cfg: Config, env: DistEnv, tokenizer: Tokenizer, rewards: Sequence[Reward],
             device_bytes: float) -> Assembled:
    """The run's parts, built step by step in the order above."""
    t = cfg.training
    state = TrainingState.start(t)
    model = build(cfg, env, build_objective(t, env))
    recompute(model, t, state)
    expert_matmul(model, t)
    pretrained(model, cfg, env)
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
    if env.is_main:
        print(fine_tuning.describe(), flush=True)
    notes(cfg, env, precision.dtype if precision.enabled else None)
    stats: Counter = Counter()
    feed, eval_set = data(cfg, tokenizer, env, stats, runner, precision, rewards)
    return Assembled(model, fine_tuning, base, precision, runner, guard, optimizer, scheduler, groups,
                     StepTimes(enabled=timed), ema, state, feed, eval_set, rewards, stats)


def build(cfg: Config, env: DistEnv, objective: Objective | None = None):
    return build_model(cfg.model, env, cfg.training.loss_subbatch_seqlen, objective)


def reference_model(model: TrainedModel, t) -> ReferenceModel | PrecomputedReference | None:
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


def recompute(model: TrainedModel, t, state) -> None:
    apply_recompute(model, state.recompute, state.recompute_layers, t.recompute_use_reentrant)


def expert_matmul(model: TrainedModel, t) -> None:
    use_expert_matmul(model, t.moe_expert_matmul)


def pretrained(model: TrainedModel, cfg: Config, env: DistEnv) -> None:
    """``training.model_name_or_path``'s weights, with the report of what was loaded, copied or drawn."""
    t = cfg.training
    if not t.model_name_or_path:
        return
    report = load_pretrained(model, t.model_name_or_path, env, mtp_init=t.mtp_init)
    drawn = [name for name in report["new"] + report["copied"] if name.startswith(MTP)]
    if drawn and t.fine_tuning == "lora":
        # an adapter holds its pairs only: loaded later, its base would lack the depths it was trained over
        raise ConfigError(
            f"training.fine_tuning=lora keeps the base's weights, and {t.model_name_or_path} has no multi-token "
            f"prediction depths (model.num_nextn_predict_layers={cfg.model.num_nextn_predict_layers}; e.g. "
            f"{drawn[0]}): an adapter over depths this run starts could not be loaded with them. Add the depths "
            "first with a full run that trains them alone (training.freeze=[vision,adapter,lm]), then LoRA from "
            "its final model; or set model.num_nextn_predict_layers=0")
    import_report(report, cfg, env)


def fine_tune(model: TrainedModel, cfg: Config, env: DistEnv):
    """(what trains, the LoRA base's reference or None)."""
    t = cfg.training
    fine_tuning = prepare_fine_tuning(model, t, cfg.model, env)
    base = None
    if t.fine_tuning == "lora":  # every rank refers to the base by the digest rank 0 took
        base = env.all_gather_object(base_reference(t.model_name_or_path) if env.is_main else None)[0]
    return fine_tuning, base


def quantize(model: TrainedModel, t, fine_tuning) -> None:
    if t.quantize_base:
        refuse_a_quantized_base(t.model_name_or_path)
        fine_tuning.quantized = (t.quantize_base, quantize_base(model, t.quantize_base, t.quantize_group_size))


def shard_weights(model: TrainedModel, groups: dict, env: DistEnv) -> list[ShardSet]:
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


def cast(model: TrainedModel, t) -> Precision:
    precision = Precision(t)
    precision.cast_model(model)
    return precision


def data(cfg: Config, tokenizer: Tokenizer, env: DistEnv, stats: Counter, runner: PlainRunner | PipelineRunner,
         precision: Precision, rewards: Sequence[Reward]) -> tuple[Feed, object | None]:
    """(the training feed, the held-out set or None); the data report; a preference run's precomputed
    reference."""
    train_set, eval_set = build_datasets(cfg)
    feed = build_feed(cfg, train_set, tokenizer, env, stats, runner, precision, rewards)
    feed.gate()  # the reader's Python waits for the backward passes, so the forward's is not held up
    report_data(train_set, tokenizer, cfg, env)
    if runner.reference is not None:  # a precomputed one is computed or read now, with the data
        sets = {"train": train_set} if eval_set is None else {"train": train_set, "eval": eval_set}
        done = runner.reference.prepare(runner, sets, tokenizer, cfg, env)
        if done and env.is_main:
            print(done, flush=True)
    return feed, eval_set
