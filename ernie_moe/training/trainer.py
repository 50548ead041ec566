"""The training loop: build everything from the config, then step, log, evaluate and save."""

from __future__ import annotations

import contextlib
import json
import time
from collections import Counter
from pathlib import Path

import paddle
import paddle.distributed as dist
from tqdm import tqdm

from .. import faults, host_reads, json_files
from ..checkpoint import (
    Run,
    TrainingParts,
    claim_output_dir,
    load_checkpoint,
    resolve,
    save_model,
    start_checkpoint,
)
from ..checkpoint.checkpoint import PendingCheckpoint
from ..checkpoint.engines import check_folder, summary_lines
from ..checkpoint.files import BackgroundWrites
from ..checkpoint.lineage import Checkpoint
from ..checkpoint.model_files import PADDLEFORMERS, folder_config, inference_files
from ..checkpoint.output_lock import release_output_dir
from ..checkpoint.pretrained import format_report, load_pretrained
from ..checkpoint.remote_code import ship_remote_code
from ..config import Config, ConfigError
from ..data import build_datasets, build_tokenizer, collate
from ..data.feeding.feed import Feed
from ..data.feeding.held_out_rows import held_out_batches
from ..data.feeding.loader import sample_encoder, training_encoder
from ..data.feeding.report import data_report, describe
from ..elastic.job import JobRecord, job_id
from ..evaluation.results import read_benchmarks, unknown_warnings
from ..finetune.adapter_files import save_adapter
from ..finetune.lora import LoRASettings
from ..host_reads import HostReadCounter
from ..model.parameter_kinds import MTP
from ..monitor.monitor import TrainingMonitor, progress_figures
from ..objectives.rewards import build_rewards
from ..objectives.sums import loss_weights
from ..parallel import init_distributed
from ..parallel.global_batch import for_world
from ..parallel.zero import norms_over_owners, whole_weights
from ..paths import write_output
from ..timing import part
from .assembly import assemble
from .benchmark_eval import benchmark_metrics
from .best_model import BestModel
from .feeds import build_feed
from .generation_eval import evaluate_by_generation
from .memory_guard import Rung
from .optimizer import clip_gradients, gradient_norms, optimizer_state_bytes
from .precision import NonFiniteGradients
from .replica_check import ReplicaCheck, ReplicasDiffer
from .run_folder import RUN_FILES, RunFolder
from .startup import check_memory, check_tokenizer, device_bytes, sized_to_tokenizer
from .state import StepResult, TrainingState, read_results
from .stop import StopRequested, StopWatch

# A run that skipped more than this share of its steps for non-finite gradients ends as a failure.
MAX_SKIPPED_FRACTION = 0.5


class Trainer:
    def __init__(self, cfg: Config):
        # under the elastic launcher: a restart keeps the global batch of the job's first attempt
        job = JobRecord(cfg.training.output_dir, job_id()) if job_id() else None
        self.cfg = cfg = for_world(cfg, dist.get_world_size(), job.first_global_batch() if job else 0)
        self.env = init_distributed(cfg.parallel, cfg.training)
        self.tokenizer = build_tokenizer(cfg)
        self.cfg = cfg = sized_to_tokenizer(cfg, self.tokenizer, self.env.is_main)
        t = cfg.training
        check_memory(cfg, self.env)  # before the output folder is claimed: a layout that cannot fit writes nothing
        self.rewards = build_rewards(t)  # the user's reward functions imported, before anything is written
        earlier = claim_output_dir(t, self.env, job, RUN_FILES)
        self.run = Run.begin(self.env)
        paddle.seed(t.seed)
        check_tokenizer(self.tokenizer, cfg.model)
        self.state = TrainingState.start(t)
        parts = assemble(cfg, self.env, self.state, device_bytes(t), self._initialise_from)
        self.model, self.fine_tuning, self.base = parts.model, parts.fine_tuning, parts.base
        self.precision, self.runner, self.guard = parts.precision, parts.runner, parts.guard
        self.optimizer, self.scheduler, self.param_groups = parts.optimizer, parts.scheduler, parts.param_groups
        self.step_times, self.ema = parts.step_times, parts.ema
        self.replicas = ReplicaCheck(t, self.env, self.model)
        if self.env.is_main:
            print(self.fine_tuning.describe(), flush=True)
        self._notes()
        self.data_stats: Counter = Counter()  # skipped and fitted samples, the data/ metrics
        self.feed, self.eval_set = self._build_data()
        self.benchmarks = read_benchmarks(t.eval_benchmarks, "training.eval_benchmarks")
        for line in unknown_warnings(self.benchmarks, self.tokenizer) if self.env.is_main else []:
            print(f"WARNING {line}", flush=True)
        self.last_checkpoint: Checkpoint | None = None  # the lineage's newest: a resume's source, then its saves
        self.writes = BackgroundWrites() if t.async_save else None  # the thread that writes saves in the background
        self.pending_save: PendingCheckpoint | None = None  # a save being written in the background
        if t.resume_from_checkpoint or earlier:
            self._resume({a.run_id for a in earlier})
        self.folder = RunFolder(cfg, self.env, job)
        self.folder.begin_attempt(earlier, self.step, self.run.run_id)
        self.best = BestModel(t, resumed=self.step > 0)
        job_figures = {"job/restarts": len(earlier), "job/world_size": self.env.world_size} if job else {}
        self.monitor = TrainingMonitor(cfg, self.env, self.model, self.runner.gather_stages, resumed_at=self.step,
                                       optimizer_bytes=lambda: optimizer_state_bytes(self.optimizer),
                                       constants=job_figures)

    @property
    def step(self) -> int:
        return self.state.step

    @step.setter
    def step(self, value: int) -> None:
        self.state.step = value

    @property
    def parts(self) -> TrainingParts:
        return TrainingParts(self.model, self.optimizer, self.scheduler, self.precision, self.state, self.feed,
                             self.base, self.ema)

    # ------------------------------------------------------------------ loop
    def train(self) -> dict:
        """The run to its end (or its stop); the output folder's lock is let go however it ends."""
        try:
            return self._train()
        finally:
            release_output_dir(self.cfg.training.output_dir)

    def _train(self) -> dict:
        t = self.cfg.training
        self.monitor.config(self.folder.write_config())
        self._check_replicas(f"after the resume at step {self.step}" if self.step else "at the start")
        self.monitor.start()
        bar = tqdm(total=t.max_steps, initial=self.step, mininterval=2.0, dynamic_ncols=True, desc="train",
                   disable=not (self.env.is_main and self.cfg.logging.progress_bar))
        window, last_eval, started, first = [], {}, time.time(), self.step + 1
        skipped_before = self.precision.skipped
        reads = HostReadCounter() if self.cfg.logging.count_host_reads else None
        with StopWatch(self.env, t.save_on_signal) as stop:
            for self.step in range(first, t.max_steps + 1):
                # the run's first step is not counted: its one-time reads set things up (fleet's pipeline learns its
                # tensors' shapes, a fused kernel is checked at its first call)
                try:
                    with reads.counting() if reads and self.step > first else contextlib.nullcontext():
                        window.append(self.train_step())
                except NonFiniteGradients as err:
                    raise self._back_to_checkpoint(err) from None
                if faults.at("hold_in_step", self.step, self.env.rank):
                    stop.hold(faults.released)
                bar.update(1)
                if self._ends_window():
                    results = read_results(window)
                    metrics = self.monitor.end_window(self.step, results, self.data_stats,
                                                      self.feed.window_metrics(sum(r.time for r in results)))
                    self.monitor.answers(self.step, self.feed.window_answers())
                    bar.set_postfix(progress_figures(metrics))
                    for line in self.monitor.warnings if self.env.is_main else []:
                        bar.write(f"WARNING {line}")
                    window = []
                    self._finish_save(wait=False)
                if self.replicas.due(self.step):  # before the EMA's evaluation, which rewrites the replicas
                    self._check_replicas(f"after step {self.step}")
                stopping_early = False
                if (t.eval_steps and self.step % t.eval_steps == 0) or self.step == t.max_steps:
                    last_eval = self.evaluate()
                    self.monitor.log_eval(self.step, last_eval)
                    stopping_early = self._keep_best(last_eval)
                if (t.save_steps and self.step % t.save_steps == 0) or self.step == t.max_steps or stopping_early:
                    self._save()
                if stopping_early:
                    break
                reason = stop.agreed()
                if reason:
                    self._stop(reason, bar)
        bar.close()
        self._finish_save()
        self.feed.close()
        last = max(self.step, first - 1)
        stopped_early = self.best.patience_spent and last < t.max_steps
        ran, skipped = last - first + 1, self.precision.skipped - skipped_before
        # trained: the steps that updated the weights (a step skipped for inf/nan gradients did not)
        summary = {"steps": last, "run_steps": ran, "trained_steps": ran - skipped,
                   "skipped_steps": skipped,
                   "train_time_s": time.time() - started, **last_eval, **self.best.summary(),
                   **({"stopped_early": f"no improvement of {t.save_best_metric} in {self.best.since} evaluations "
                                        f"(training.early_stopping_patience)"} if stopped_early else {}),
                   **{f"data/{k}": v for k, v in sorted(self.data_stats.items())},
                   **({"host_reads": self._host_reads(reads, ran - 1)} if reads else {})}
        if skipped > ran * MAX_SKIPPED_FRACTION:
            self.folder.write_summary({**summary, "status": "failed"})
            self.monitor.close()
            raise NonFiniteGradients(
                f"{skipped} of the {ran} steps of this run were skipped for non-finite gradients (inf/nan), so "
                "the model hardly trained; no final model was written. Check the config (rope_theta, rms_norm_eps, "
                "learning rate) and the data.")
        self._finish(summary)
        return summary

    def _host_reads(self, reads: HostReadCounter, steps: int) -> dict:
        """Each rank's device-to-host reads in the run's training steps after its first
        (``logging.count_host_reads``)."""
        per_rank = [reads.total()]
        if self.env.world_size > 1:
            per_rank = []
            dist.all_gather_object(per_rank, reads.total())
        return {"steps": steps, "per_rank": per_rank}

    def _stop(self, reason: str, bar) -> None:
        """Stop after this step on request: a checkpoint of it (unless the step just saved one), the summary, then
        StopRequested for the run's exit code."""
        bar.close()
        self._finish_save()
        saved = self.last_checkpoint is not None and self.last_checkpoint.step == self.step
        if not saved:
            self._save()
            self._finish_save()
        where = self.last_checkpoint.path if self.last_checkpoint else "no checkpoint (the last steps were skipped)"
        self.folder.write_summary({"status": "stopped", "steps": self.step, "reason": reason,
                             "checkpoint": str(where)})
        self.feed.close()
        self.monitor.close()
        raise StopRequested(f"{reason}: stopped after step {self.step}, saved {where}; resume with "
                            "training.resume_from_checkpoint=auto")

    def _back_to_checkpoint(self, err: NonFiniteGradients) -> NonFiniteGradients:
        """A stop for non-finite gradients, naming the checkpoint to go back to."""
        self._finish_save()  # its state is from before these steps
        where = (f"the newest checkpoint, saved before these steps, is {self.last_checkpoint.path}"
                 if self.last_checkpoint else "no checkpoint was saved before them")
        return NonFiniteGradients(f"{err} ({where})")

    def _save(self) -> None:
        """Checkpoint, unless the last steps were skipped: a checkpoint from inside a run of non-finite steps
        would be the one a resume picks, and pruning would remove the good ones before it."""
        in_a_row = self.precision.skipped_in_a_row
        if in_a_row:
            if self.env.is_main:
                print(f"not saving at step {self.step}: the last {in_a_row} step(s) were skipped for non-finite "
                      "gradients", flush=True)
            return
        self._finish_save()  # a second save waits for the first
        pending = start_checkpoint(self.parts, self.cfg, self.tokenizer, self.env, self.run, self.last_checkpoint,
                                   self.writes)
        if self.writes is None:
            self.last_checkpoint = pending.finish(self.env)
        else:
            self.pending_save = pending

    def _finish_save(self, wait: bool = True) -> None:
        """Complete a save written in the background: now, waiting for this rank's files, or without ``wait``
        only once every rank has written its files (the ranks still writing are counted: one number summed over
        the job, whatever its size)."""
        pending = self.pending_save
        if pending is None:
            return
        if not wait:
            writing = paddle.to_tensor([0.0 if pending.written_here() else 1.0])
            if self.env.world_size > 1:
                dist.all_reduce(writing)  # over every rank of the job
            if float(writing):
                return
        self.pending_save = None
        self.last_checkpoint = pending.finish(self.env)

    def _next_rows(self) -> list:
        """This rank's rows of each micro-batch of the next step."""
        return self.feed.next_step(self.state.micro_batch_size, self.state.accumulation_steps)

    def next_micro_batches(self) -> list:
        return [collate(rows) for rows in self._next_rows()]

    def train_step(self, micro_batches=None) -> StepResult:
        """One optimizer step over the step's micro-batches (the feed's next, unless given), its parts timed in the
        run's ``step_times``. An out-of-memory error runs the step again on the memory guard's next rung; a window
        whose peak passed the guard's limit moves to the next rung for the steps after it."""
        with self.step_times.recording():
            started, ends_window = time.perf_counter(), self._ends_window()
            self.step_times.sample(ends_window)
            self.step_times.pop()
            released = self.guard.release(self.state)
            if released:
                self._announce(released)
            with part("data"):
                rows = None if micro_batches is not None else self._next_rows()
            data_wait = time.perf_counter() - started  # measured whether or not the time breakdown is on
            rungs: list[Rung] = []
            result = None
            while result is None:
                with self.guard.attempt(self.state, rungs):
                    with part("data"):
                        batches = micro_batches or [collate(r) for r in rows or []]
                    done = self.forward_backward(batches)
                    with part("gradient_sync"):
                        self.runner.finish_gradients()
                    with part("optimizer"):
                        self._update(done)
                        if self.ema is not None:
                            self.ema.update(self.step)
                    result = done
                if result is None:  # out of memory: the attempt's gradients dropped, its rows cut as the rung says
                    self.optimizer.clear_grad()
                    if rungs[-1].halved and rows is not None:
                        rows = [half for r in rows for half in (r[: len(r) // 2], r[len(r) // 2:])]
            if faults.at("perturb_weight", self.step, self.env.rank):
                self.replicas.perturb()
            for fault in ("sigterm_in_step", "launcher_killed", "kill_in_step", "node_lost"):
                faults.hit(fault, self.step, self.env.rank)
            later = self.guard.after_step(self.state, self.monitor.after_step(), ends_window)
            for rung in rungs + ([later] if later is not None else []):
                self._announce(rung.message)
            result.memory_guard_rungs = len(rungs) + (later is not None)
            result.loss_scale = self.precision.loss_scale
            result.rows = self.state.micro_batch_size * self.env.data_world * self.state.accumulation_steps
            result.flops = self.monitor.step_flops(batches)
            result.time, result.times = time.perf_counter() - started, self.step_times.pop()
            result.data_wait = data_wait
        return result

    def _ends_window(self) -> bool:
        """Whether this step ends a logging window: the step whose figures the host may wait for."""
        return self.step % self.cfg.logging.logging_steps == 0 or self.step == self.cfg.training.max_steps

    def _check_replicas(self, when: str) -> None:
        """The replica check (every rank): its figures logged, a mismatch stopping the run or warning."""
        if not self.replicas.enabled:
            return
        with whole_weights(self.model):
            metrics, mismatch = self.replicas.run(when)
        self.monitor.log_check(self.step, metrics)
        if mismatch is None:
            return
        if self.cfg.training.replica_check == "stop":
            self.folder.write_summary({"status": "failed", "steps": self.step, "reason": mismatch})
            self.monitor.close()
            raise ReplicasDiffer(mismatch)
        if self.env.is_main:
            print(f"WARNING {mismatch}", flush=True)

    def _announce(self, change: str) -> None:
        if self.env.is_main:
            print(f"memory guard: {change}", flush=True)
        self.monitor.text("memory_guard", change, self.step)

    def _update(self, result: StepResult) -> None:
        """Unscale, clip and step (or skip a step with non-finite gradients), then clear the gradients."""
        t, env = self.cfg.training, self.env
        self.precision.unscale(p for params in self.param_groups.values() for p in params)
        norms = gradient_norms(
            self.param_groups, reduce=norms_over_owners(self.runner.grad_sync.shards, self.param_groups,
                                                        {"expert": lambda x: env.all_reduce_sum(x, env.expert_group)}),
            reduce_split=lambda x: env.all_reduce_sum(x, env.tp_group),
            reduce_stages=self.runner.sum_over_stages, uncounted=self.runner.copies_of_other_stages())
        result.lr = self.optimizer.get_lr()
        grad_norm = float(host_reads.read(norms["grad_norm"], "finite_check"))  # the step's one read
        if self.precision.step_is_finite(grad_norm, self.step):
            result.grad_norm, result.grad_norm_expert = grad_norm, norms["grad_norm_expert"]
            result.grad_norm_non_expert = norms["grad_norm_non_expert"]
            clip_gradients(self.param_groups, t.max_grad_norm, grad_norm)
            self.optimizer.step()
            self.scheduler.step()
            self._update_router_bias()
        else:  # inf / nan somewhere: no update, and no bias update from this step's routing
            for moe in self.model.moe_layers():
                moe.stats.pop_usage()
        self.optimizer.clear_grad()

    def forward_backward(self, micro_batches) -> StepResult:
        """Accumulate the step's gradients; returns the step's loss sums and token counts over all ranks, on the
        device (read once per logging window)."""
        env, m = self.env, self.cfg.model
        counts = [b.host_counts() for b in micro_batches]  # from the host: nothing to wait for
        objective = self.runner.objective
        depths = objective.mtp_depths(m)
        local = [sum(objective.units(c) for c in counts), sum(c.tokens for c in counts)]
        local += [sum(c.labels_ahead[k] for c in counts) for k in range(depths)]  # what each MTP depth trains on
        with part("step_reduce"):
            totals = env.all_reduce_sum(paddle.to_tensor(local, dtype="float64"), env.data_group)
        label_tokens, tokens, labels_ahead = totals[0], totals[1], totals[2:]
        scale = loss_weights(env.data_world, self._loss_denominator, label_tokens, labels_ahead,
                             m.multi_token_pred_lambda)
        sums = self.runner.forward_backward(micro_batches, scale, during_backward=self.feed.reading)
        with part("step_reduce"):
            sums = env.all_reduce_sum(sums, env.data_group)
        figures = len(objective.figures)
        return StepResult(lm_loss_sum=sums[0], label_tokens=label_tokens,
                          router_loss=sums[1] / (len(micro_batches) * env.data_world), tokens=tokens,
                          figures=sums[2:2 + figures] if figures else None,
                          mtp=paddle.concat([sums[2 + figures:], labels_ahead]) if depths else None)

    def evaluate(self) -> dict:
        """The held-out figures (``eval_*``), and the EMA's beside them (``ema_eval_*``) once it has started."""
        result = self._evaluate()
        if result and self.ema is not None and self.ema.started:
            with self.ema.swapped_in():
                averaged = self._evaluate(warn=False)
            result.update({f"ema_{k}": v for k, v in averaged.items() if not k.startswith("eval_skipped")})
        return result

    def _keep_best(self, metrics: dict) -> bool:
        """Write best_model when this evaluation is the best so far; whether the run stops early here."""
        if self.best.update(self.step, metrics):
            self.best.replace(self._export, self.env)
        if self.best.metric and self.best.step is not None and self.env.is_main:
            self.best.write_record()
        stops = self.best.patience_spent and self.step < self.cfg.training.max_steps
        if stops and self.env.is_main:
            print(f"stopping early at step {self.step}: {self.best.metric} has not improved on {self.best.value:.4f} "
                  f"(step {self.best.step}) in {self.best.since} evaluations; the best model is in "
                  f"{self.best.folder}", flush=True)
        return stops

    def _evaluate(self, warn: bool = True) -> dict:
        if self.benchmarks:
            with self.precision.autocast():
                benchmarks = benchmark_metrics(self.benchmarks, self.model, self.tokenizer, self.cfg.data, self.env)
        else:
            benchmarks = {}
        if self.eval_set is None:
            return benchmarks
        skipped: Counter = Counter()
        batches = held_out_batches(self.eval_set, self.tokenizer, self.cfg, self.env,
                                   self.runner.eval_rows_per_device(self.cfg.training), skipped,
                                   self.runner.objective.row_inputs)
        result = self.runner.evaluate(batches, self.cfg.training)
        t = self.cfg.training
        if t.eval_generate:
            with self.precision.autocast():
                result.update(evaluate_by_generation(self.model, self.eval_set,
                                                     training_encoder(self.tokenizer, self.cfg, Counter()),
                                                     self.tokenizer, self.env, t.eval_generate_samples,
                                                     t.eval_generate_max_new_tokens, self.rewards))
        if not result and warn and self.env.is_main:
            print(f"WARNING the held-out data gave nothing to evaluate (skipped samples: {dict(skipped) or 'none'})",
                  flush=True)
        # held-out samples skipped are reported with the figures they are missing from
        skips = {f"eval_skipped_{reason}": count for reason, count in sorted(skipped.items())}
        return {**result, **benchmarks, **skips}

    # -------------------------------------------------------------- helpers
    def _build_data(self) -> tuple[Feed, object]:
        """The training feed (the GRPO stage's: rollouts of the policy) and the held-out set; the data report; a
        preference run's precomputed reference, with the starting weights (before a resume loads others)."""
        cfg = self.cfg
        train_set, eval_set = build_datasets(cfg)
        feed = build_feed(cfg, train_set, self.tokenizer, self.env, self.data_stats, self.runner, self.precision,
                          self.rewards)
        feed.gate()  # the reader's Python waits for the backward passes, so the forward's is not held up
        if self.env.is_main and cfg.data.report_samples:
            self._report_data(train_set)
        if self.runner.reference is not None:  # a precomputed one is computed or read now, with the data
            done = self.runner.reference.prepare(self.runner, {"train": train_set, "eval": eval_set} if
                                                 eval_set is not None else {"train": train_set},
                                                 self.tokenizer, cfg, self.env)
            if done and self.env.is_main:
                print(done, flush=True)
        return feed, eval_set

    def _resume(self, job_runs: set[str]) -> None:
        """Load the newest checkpoint of an elastic job's earlier attempts (``job_runs``), else the one
        ``training.resume_from_checkpoint`` names (``auto``: the newest of the newest run in output_dir, if any),
        and move the data stream to where it stopped. The micro-batch and recompute start again from the config
        (the memory guard steps down again where it must)."""
        t = self.cfg.training
        say = print if self.env.is_main else (lambda *_, **__: None)
        checkpoint = resolve("auto", t.output_dir, self.env, warn=say, runs=job_runs) if job_runs else None
        if checkpoint is None and t.resume_from_checkpoint:
            checkpoint = resolve(t.resume_from_checkpoint, t.output_dir, self.env, warn=say)
        if checkpoint is None:
            return
        with whole_weights(self.model):
            saved = load_checkpoint(self.parts, checkpoint.path, self.env)  # the data position too
        if "data" not in saved:
            say(f"WARNING {checkpoint.path} predates saved data positions: the data starts again from its first "
                "sample", flush=True)
        self.state.step = saved["step"]
        self.last_checkpoint = checkpoint
        step = self.state.step
        say(f"resumed from {checkpoint.path} at step {step}", flush=True)
        change = self.scheduler.resume(saved.get("schedule"), step, t.reset_schedule_on_resume)
        if change:
            say(change, flush=True)
        if step >= t.max_steps:
            say(f"nothing to train: the checkpoint is at step {step} and training.max_steps is {t.max_steps}; "
                "raise training.max_steps to train further", flush=True)

    def _loss_denominator(self, label_tokens: paddle.Tensor) -> paddle.Tensor:
        """What a loss summed over ``label_tokens`` (a device count, or one per MTP depth) is divided by."""
        t = self.cfg.training
        if t.token_balance_loss:
            per_micro = t.token_balance_seqlen or self.cfg.data.max_seq_len * self.state.micro_batch_size
            return paddle.full(label_tokens.shape, per_micro * self.state.accumulation_steps * self.env.data_world,
                               dtype="float32")
        return paddle.clip(label_tokens, min=1.0).astype("float32")

    def _update_router_bias(self) -> None:
        for moe in self.model.moe_layers():
            if moe.moe_statics is not None:
                moe.update_correction_bias(self.env.all_reduce_sum(moe.stats.pop_usage(), self.env.data_group))
            else:
                moe.stats.pop_usage()

    def _initialise_from(self, model, directory: str) -> None:
        report = load_pretrained(model, directory, self.env, mtp_init=self.cfg.training.mtp_init)
        drawn = [name for name in report["new"] + report["copied"] if name.startswith(MTP)]
        if drawn and self.cfg.training.fine_tuning == "lora":
            # an adapter holds its pairs only: loaded later, its base would lack the depths it was trained over
            raise ConfigError(
                f"training.fine_tuning=lora keeps the base's weights, and {directory} has no multi-token prediction "
                f"depths (model.num_nextn_predict_layers={self.cfg.model.num_nextn_predict_layers}; e.g. {drawn[0]}): "
                "an adapter over depths this run starts could not be loaded with them. Add the depths first with a "
                "full run that trains them alone (training.freeze=[vision,adapter,lm]), then LoRA from its final "
                "model; or set model.num_nextn_predict_layers=0")
        if self.env.is_main:
            print(format_report(report), flush=True)
            out = Path(self.cfg.training.output_dir)
            out.mkdir(parents=True, exist_ok=True)
            write_output(out / "import_report.json", json.dumps(report, indent=2))

    def _report_data(self, train_set) -> None:
        """One encoded sample and the data's figures, printed and written to data_report.json."""
        d = self.cfg.data
        report = data_report(train_set, sample_encoder(self.tokenizer, self.cfg, Counter()), self.tokenizer,
                             d.report_samples, self.cfg.training.seed)
        print(describe(report), flush=True)
        write_output(Path(self.cfg.training.output_dir) / "data_report.json", json_files.dumps(report, indent=2))

    def _notes(self) -> None:
        """What a setting does not do on this machine, said once by rank 0."""
        t = self.cfg.training
        if not self.env.is_main:
            return
        if self.precision.enabled and not paddle.is_compiled_with_cuda():
            print(f"note: {self.precision.dtype} mixed precision needs a GPU; on this CPU build Paddle computes in "
                  "float32 (loss scaling and the inf/nan step guard still apply)", flush=True)
        if t.final_model_format == "transformers" and self.cfg.model.num_nextn_predict_layers:
            print("note: the final model in transformers' form leaves the multi-token prediction layers out "
                  "(transformers' ERNIE-4.5-VL has none); the checkpoints keep them", flush=True)
        if t.offload_optim and not paddle.device.get_device().startswith("gpu"):
            print("note: training.offload_optim keeps optimizer states in host memory between steps; on a CPU that "
                  "is where they already are, so it saves nothing here (the same moves run)", flush=True)

    def _finish(self, summary: dict) -> None:
        final = Path(self.cfg.training.output_dir) / "final_model"
        averaged = self._export(final)
        summary.update(status="done", model_dir=str(final), final_model_weights="ema" if averaged else "trained")
        rollouts = Path(self.cfg.training.output_dir) / "rollouts.jsonl"
        if rollouts.is_file():  # the GRPO stage's sampled answers: said where they are
            summary["rollouts"] = str(rollouts)
        if self.env.is_main:  # whether vLLM, SGLang and FastDeploy would serve it as trained
            reports = check_folder(final)
            summary["serving_engines"] = {r.engine: r.as_dict() for r in reports}
            print("\n".join(summary_lines(reports)), flush=True)
        self.folder.write_summary(summary)
        self.monitor.close()

    def _export(self, folder: Path) -> bool:
        """The model folder (or, for LoRA, the adapter) of the weights now; whether they were the EMA's."""
        # sharding stage 3: a full model's weights are gathered one by one as they are written, an adapter's together
        with whole_weights(self.model) if self.base is not None else contextlib.nullcontext():
            return self._write_model(folder)

    def _write_model(self, folder: Path) -> bool:
        t = self.cfg.training
        files = inference_files(self.cfg, self.tokenizer, t.final_model_format)
        ema = self.ema if t.save_ema_as_final and self.ema is not None and self.ema.started else None
        averaged = ema is not None
        with ema.swapped_in() if ema is not None else contextlib.nullcontext():
            if self.base is not None:  # the adapter alone, as PaddleFormers' LoRAModel reads it
                save_adapter(self.model, self.cfg.model, LoRASettings.of(t), folder, self.tokenizer, self.env,
                             self.base, files)
            else:
                save_model(self.model, self.cfg.model, str(folder), self.tokenizer, self.env, hf_layout=True,
                           source=folder_config(t.model_name_or_path), extra=files, form=t.final_model_format)
                if self.env.is_main and t.final_model_format == PADDLEFORMERS:
                    ship_remote_code(folder, t.model_name_or_path)
        return averaged
