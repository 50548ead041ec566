"""The training loop: assemble the run's parts from the config, then step, log, evaluate and save."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import paddle
import paddle.distributed as dist
from tqdm import tqdm

from .. import faults, host_reads
from ..checkpoint import Run, claim_output_dir, load_checkpoint, resolve
from ..checkpoint.output_lock import release_output_dir
from ..config import Config
from ..data import build_tokenizer, collate
from ..elastic.job import JobRecord, job_id
from ..evaluation.in_training import TrainingEvaluation
from ..host_reads import HostReadCounter
from ..monitor.monitor import TrainingMonitor, progress_figures
from ..objectives.rewards import build_rewards
from ..objectives.sums import StepCounts, StepSums, loss_denominator, loss_weights
from ..parallel import init_distributed
from ..parallel.global_batch import for_world
from ..parallel.zero import norms_over_owners, whole_weights
from ..timing import part
from .assembly import assemble
from .best_model import BestModel
from .final_model import export, serving_check
from .memory_guard import Rung
from .optimizer import clip_gradients, gradient_norms, optimizer_state_bytes
from .precision import NonFiniteGradients
from .replica_check import ReplicaCheck, ReplicasDiffer
from .run_folder import RUN_FILES, RunFolder
from .saves import Saves
from .startup import check_memory, check_tokenizer, device_bytes, sized_to_tokenizer
from .state import StepResult, read_results
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
        rewards = build_rewards(t)  # the user's reward functions imported, before anything is written
        earlier = claim_output_dir(t, self.env, job, RUN_FILES)
        self.run = Run.begin(self.env)
        paddle.seed(t.seed)
        check_tokenizer(self.tokenizer, cfg.model)
        self.parts = parts = assemble(cfg, self.env, self.tokenizer, rewards, device_bytes(t))
        self.replicas = ReplicaCheck(t, self.env, parts.model)
        self.evaluation = TrainingEvaluation(cfg, self.env, self.tokenizer, parts.eval_set, rewards)
        self.saves = Saves(cfg, self.tokenizer, self.env, self.run, parts)
        if t.resume_from_checkpoint or earlier:
            self._resume({a.run_id for a in earlier})
        self.folder = RunFolder(cfg, self.env, job)
        self.folder.begin_attempt(earlier, self.step, self.run.run_id)
        self.best = BestModel(t, resumed=self.step > 0)
        job_figures = {"job/restarts": len(earlier), "job/world_size": self.env.world_size} if job else {}
        self.monitor = TrainingMonitor(cfg, self.env, parts.model, parts.runner.gather_stages, resumed_at=self.step,
                                       optimizer_bytes=lambda: optimizer_state_bytes(parts.optimizer),
                                       constants=job_figures)

    @property
    def step(self) -> int:
        return self.parts.state.step

    @step.setter
    def step(self, value: int) -> None:
        self.parts.state.step = value

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
        skipped_before = self.parts.precision.skipped
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
                    metrics = self.monitor.end_window(self.step, results, self.parts.data_stats,
                                                      self.parts.feed.window_metrics(sum(r.time for r in results)))
                    self.monitor.answers(self.step, self.parts.feed.window_answers())
                    bar.set_postfix(progress_figures(metrics))
                    for line in self.monitor.warnings if self.env.is_main else []:
                        bar.write(f"WARNING {line}")
                    window = []
                    self.saves.finish(wait=False)
                if self.replicas.due(self.step):  # before the EMA's evaluation, which rewrites the replicas
                    self._check_replicas(f"after step {self.step}")
                stopping_early = False
                if (t.eval_steps and self.step % t.eval_steps == 0) or self.step == t.max_steps:
                    last_eval = self.evaluate()
                    self.monitor.log_eval(self.step, last_eval)
                    stopping_early = self._keep_best(last_eval)
                if (t.save_steps and self.step % t.save_steps == 0) or self.step == t.max_steps or stopping_early:
                    self.saves.save()
                if stopping_early:
                    break
                reason = stop.agreed()
                if reason:
                    self._stop(reason, bar)
        bar.close()
        self.saves.finish()
        self.parts.feed.close()
        last = max(self.step, first - 1)
        stopped_early = self.best.patience_spent and last < t.max_steps
        ran, skipped = last - first + 1, self.parts.precision.skipped - skipped_before
        # trained: the steps that updated the weights (a step skipped for inf/nan gradients did not)
        summary = {"steps": last, "run_steps": ran, "trained_steps": ran - skipped,
                   "skipped_steps": skipped,
                   "train_time_s": time.time() - started, **last_eval, **self.best.summary(),
                   **({"stopped_early": f"no improvement of {t.save_best_metric} in {self.best.since} evaluations "
                                        f"(training.early_stopping_patience)"} if stopped_early else {}),
                   **{f"data/{k}": v for k, v in sorted(self.parts.data_stats.items())},
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
        self.saves.finish()
        saved = self.saves.last is not None and self.saves.last.step == self.step
        if not saved:
            self.saves.save()
            self.saves.finish()
        where = self.saves.last.path if self.saves.last else "no checkpoint (the last steps were skipped)"
        self.folder.write_summary({"status": "stopped", "steps": self.step, "reason": reason,
                                   "checkpoint": str(where)})
        self.parts.feed.close()
        self.monitor.close()
        raise StopRequested(f"{reason}: stopped after step {self.step}, saved {where}; resume with "
                            "training.resume_from_checkpoint=auto")

    def _back_to_checkpoint(self, err: NonFiniteGradients) -> NonFiniteGradients:
        """A stop for non-finite gradients, naming the checkpoint to go back to."""
        self.saves.finish()  # its state is from before these steps
        where = (f"the newest checkpoint, saved before these steps, is {self.saves.last.path}"
                 if self.saves.last else "no checkpoint was saved before them")
        return NonFiniteGradients(f"{err} ({where})")

    def _next_rows(self) -> list:
        """This rank's rows of each micro-batch of the next step."""
        return self.parts.feed.next_step(self.parts.state.micro_batch_size, self.parts.state.accumulation_steps)

    def next_micro_batches(self) -> list:
        return [collate(rows) for rows in self._next_rows()]

    def train_step(self, micro_batches=None) -> StepResult:
        """One optimizer step over the step's micro-batches (the feed's next, unless given), its parts timed in the
        run's ``step_times``. An out-of-memory error runs the step again on the memory guard's next rung; a window
        whose peak passed the guard's limit moves to the next rung for the steps after it."""
        parts = self.parts
        with parts.step_times.recording():
            started, ends_window = time.perf_counter(), self._ends_window()
            parts.step_times.sample(ends_window)
            parts.step_times.pop()
            released = parts.guard.release(parts.state)
            if released:
                self._announce(released)
            with part("data"):
                rows = None if micro_batches is not None else self._next_rows()
            data_wait = time.perf_counter() - started  # measured whether or not the time breakdown is on

            rungs: list[Rung] = []
            result, batches = None, micro_batches or []
            for attempt in parts.guard.attempts(parts.state, rows, rungs, parts.optimizer.clear_grad):
                with attempt:
                    with part("data"):
                        batches = micro_batches or [collate(r) for r in attempt.rows or []]
                    result = self.forward_backward(batches)
                    with part("gradient_sync"):
                        parts.runner.finish_gradients()
                    with part("optimizer"):
                        self._update(result)
                        if parts.ema is not None:
                            parts.ema.update(self.step)
            assert result is not None  # the last attempt ran to its end (an error without a rung goes on)
            if faults.at("perturb_weight", self.step, self.env.rank):
                self.replicas.perturb()
            for fault in ("sigterm_in_step", "launcher_killed", "kill_in_step", "node_lost"):
                faults.hit(fault, self.step, self.env.rank)
            later = parts.guard.after_step(parts.state, self.monitor.after_step(), ends_window)
            for rung in rungs + ([later] if later is not None else []):
                self._announce(rung.message)
            result.memory_guard_rungs = len(rungs) + (later is not None)
            result.loss_scale = parts.precision.loss_scale
            result.rows = parts.state.micro_batch_size * self.env.data_world * parts.state.accumulation_steps
            result.flops = self.monitor.step_flops(batches)
            result.time, result.times = time.perf_counter() - started, parts.step_times.pop()
            result.data_wait = data_wait
        return result

    def _ends_window(self) -> bool:
        """Whether this step ends a logging window: the step whose figures the host may wait for."""
        return self.step % self.cfg.logging.logging_steps == 0 or self.step == self.cfg.training.max_steps

    def _check_replicas(self, when: str) -> None:
        """The replica check (every rank): its figures logged, a mismatch stopping the run or warning."""
        if not self.replicas.enabled:
            return
        with whole_weights(self.parts.model):
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
        env, parts = self.env, self.parts
        groups, runner = parts.param_groups, parts.runner
        parts.precision.unscale(p for params in groups.values() for p in params)
        by_owners = norms_over_owners(runner.grad_sync.shards, groups,
                                      {"expert": lambda x: env.all_reduce_sum(x, env.expert_group)})
        norms = gradient_norms(groups, reduce=by_owners, reduce_split=lambda x: env.all_reduce_sum(x, env.tp_group),
                               reduce_stages=runner.sum_over_stages, uncounted=runner.copies_of_other_stages())
        result.lr = parts.optimizer.get_lr()
        grad_norm = float(host_reads.read(norms["grad_norm"], "finite_check"))  # the step's one read
        if parts.precision.step_is_finite(grad_norm, self.step):
            result.grad_norm, result.grad_norm_expert = grad_norm, norms["grad_norm_expert"]
            result.grad_norm_non_expert = norms["grad_norm_non_expert"]
            clip_gradients(groups, self.cfg.training.max_grad_norm, grad_norm)
            parts.optimizer.step()
            parts.scheduler.step()
            self._update_router_bias()
        else:  # inf / nan somewhere: no update, and no bias update from this step's routing
            for moe in parts.model.moe_layers():
                moe.stats.pop_usage()
            result.nonfinite = parts.precision.nonfinite_parts(parts.model, env, self.step)
        parts.optimizer.clear_grad()

    def forward_backward(self, micro_batches) -> StepResult:
        """Accumulate the step's gradients; returns the step's loss sums and token counts over all ranks, on the
        device (read once per logging window)."""
        env, parts, m = self.env, self.parts, self.cfg.model
        objective = parts.runner.objective
        depths = objective.mtp_depths(m)
        local = StepCounts.local(objective, [b.host_counts() for b in micro_batches], depths)  # from the host
        with part("step_reduce"):
            counts = StepCounts.of(env.all_reduce_sum(local, env.data_group))
        state = parts.state
        denominator = loss_denominator(self.cfg.training, self.cfg.data.max_seq_len, state.micro_batch_size,
                                       state.accumulation_steps, env.data_world)
        scale = loss_weights(env.data_world, denominator, counts.units, counts.labels_ahead,
                             m.multi_token_pred_lambda)
        sums = parts.runner.forward_backward(micro_batches, scale, during_backward=parts.feed.reading)
        with part("step_reduce"):
            step = StepSums.of(env.all_reduce_sum(sums, env.data_group), len(objective.figures), depths)
        return StepResult(lm_loss_sum=step.loss, label_tokens=counts.units, tokens=counts.tokens,
                          router_loss=step.router / (len(micro_batches) * env.data_world), figures=step.figures,
                          mtp=paddle.concat([step.mtp, counts.labels_ahead]) if step.mtp is not None else None)

    def evaluate(self) -> dict:
        """The held-out figures (``eval_*``), and the EMA's beside them (``ema_eval_*``) once it has started."""
        parts = self.parts
        return self.evaluation(parts.model, parts.runner, parts.precision, parts.ema)

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
        with whole_weights(self.parts.model):
            saved = load_checkpoint(self.parts, checkpoint.path, self.env)  # the data position too
        if "data" not in saved:
            say(f"WARNING {checkpoint.path} predates saved data positions: the data starts again from its first "
                "sample", flush=True)
        self.parts.state.step = saved["step"]
        self.saves.last = checkpoint
        step = self.parts.state.step
        say(f"resumed from {checkpoint.path} at step {step}", flush=True)
        change = self.parts.scheduler.resume(saved.get("schedule"), step, t.reset_schedule_on_resume)
        if change:
            say(change, flush=True)
        if step >= t.max_steps:
            say(f"nothing to train: the checkpoint is at step {step} and training.max_steps is {t.max_steps}; "
                "raise training.max_steps to train further", flush=True)

    def _update_router_bias(self) -> None:
        for moe in self.parts.model.moe_layers():
            if moe.moe_statics is not None:
                moe.update_correction_bias(self.env.all_reduce_sum(moe.stats.pop_usage(), self.env.data_group))
            else:
                moe.stats.pop_usage()

    def _finish(self, summary: dict) -> None:
        final = Path(self.cfg.training.output_dir) / "final_model"
        averaged = self._export(final)
        summary.update(status="done", model_dir=str(final), final_model_weights="ema" if averaged else "trained")
        rollouts = Path(self.cfg.training.output_dir) / "rollouts.jsonl"
        if rollouts.is_file():  # the GRPO stage's sampled answers: said where they are
            summary["rollouts"] = str(rollouts)
        if self.env.is_main:
            summary["serving_engines"] = serving_check(final)
        self.folder.write_summary(summary)
        self.monitor.close()

    def _export(self, folder: Path) -> bool:
        return export(self.parts, self.cfg, self.tokenizer, self.env, folder)
