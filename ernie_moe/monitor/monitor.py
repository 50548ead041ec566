"""Everything the trainer reports once per logging window, gathered in one place."""

from __future__ import annotations

from collections import Counter

import numpy as np
import paddle

from ..config.schema import Config
from ..data.encoding.packing import FIT_COUNTS
from ..timing import COMMUNICATION
from .alerts import Alerts
from .expert_balance import layer_windows, summarize
from .flops import FlopsCounter, hardware_peak
from .memory import MemoryMonitor
from .metrics import MetricsLogger


class TrainingMonitor:
    def __init__(self, cfg: Config, env, model, gather_stages, resumed_at: int = 0, optimizer_bytes=None,
                 constants: dict | None = None):
        """``optimizer_bytes()``: the bytes of this rank's optimizer states, reported per rank; ``constants``:
        figures logged unchanged with every window (an elastic job's restarts and world size)."""
        self.env, self.model, self.gather_stages = env, model, gather_stages
        self.constants = dict(constants or {})
        self.optimizer_bytes = optimizer_bytes
        self.enabled = cfg.logging.monitor
        self.logger = MetricsLogger(cfg.training.output_dir, cfg.logging.visualdl, env.is_main, resumed_at)
        for moe in model.moe_layers():
            moe.stats.enabled = self.enabled
        self.memory = MemoryMonitor()  # also what the memory guard reads
        if self.enabled:
            self.flops = FlopsCounter(model, cfg.model)
            self.peak_flops, self.peak_source = hardware_peak() if env.is_main else (0.0, "")
            self.alerts = Alerts(cfg.logging, self.memory.device_total_gb())
        self.warnings: list[str] = []

    def step_flops(self, micro_batches) -> float:
        return sum(self.flops.batch_flops(b) for b in micro_batches) if self.enabled else 0.0

    def start(self) -> None:
        """Training begins: memory peaks count from here (set-up is not a step)."""
        self.memory.pop_window()

    def after_step(self) -> int:
        """The step's memory peak in bytes."""
        return self.memory.step_peak()

    def end_window(self, step: int, results: list, data_stats, feed_metrics: dict | None = None) -> dict:
        """Log the metrics of the window's step results, read to the host (``StepResult.read``; rank 0 writes,
        every rank takes part in the reductions), with the feed's figures (a rollout's rewards), and return them."""
        steps = len(results)
        updated = [r for r in results if not r.skipped]  # gradient norms of skipped steps are not finite

        def total(key):
            return sum(getattr(r, key) for r in results)

        def per_update(key):
            return sum(getattr(r, key) for r in updated) / len(updated) if updated else float("nan")

        lm_loss = total("lm_loss_sum") / max(total("label_tokens"), 1.0)
        router_loss = total("router_loss") / steps
        elapsed = total("time")
        metrics = {
            "loss": lm_loss + router_loss, "lm_loss": lm_loss, "router_loss": router_loss,
            "lr": total("lr") / steps,
            "grad_norm": per_update("grad_norm"),
            "grad_norm_expert": per_update("grad_norm_expert"),
            "grad_norm_non_expert": per_update("grad_norm_non_expert"),
            "skipped_steps": steps - len(updated),
            "memory_guard_rungs": total("memory_guard_rungs"),
            "loss_scale": total("loss_scale") / steps,
            "tokens_per_sec": total("tokens") / elapsed,
            "samples_per_sec": total("rows") / elapsed,
            "step_time_s": elapsed / steps,
            "data_wait_s": total("data_wait") / steps,  # the loop waiting for rows (data.num_workers hides it)
        }
        metrics.update(time_breakdown(results))
        nonfinite: Counter = Counter()
        for r in results:
            nonfinite.update(r.nonfinite)
        metrics.update({f"nonfinite/{part}": n for part, n in sorted(nonfinite.items())})
        mtp = [r.mtp for r in results if r.mtp is not None]
        if mtp:
            metrics.update(mtp_metrics(np.sum(mtp, axis=0)))
        figures = [r.figures for r in results if r.figures is not None]
        if figures:
            objective = self.model.objective
            metrics.update(objective.metrics(np.sum(figures, axis=0), f"{objective.name}/"))
        metrics.update(self.model.objective.window_maxima(self.env.all_reduce_max))
        for moe in self.model.moe_layers():
            moe.stats.all_reduce(lambda t: self.env.all_reduce_sum(t, self.env.data_group))
        # every stage's layers reach rank 0
        windows = [w for stage in self.gather_stages(layer_windows(self.model.moe_layers())) for w in stage]
        scalars, images = summarize(windows)
        metrics.update(scalars)
        if self.enabled:
            tflops = total("flops") / elapsed / 1e12
            metrics["model_tflops_per_card"] = tflops
            if self.peak_flops:
                metrics["mfu"] = tflops * 1e12 / self.peak_flops
            memory = self._memory_per_rank()
            metrics.update(memory)
            peak = max(v for k, v in memory.items() if k.startswith("memory/max_rank_"))
            # the MoE figures and the feed's (the GRPO rollouts' equal-reward share)
            self.warnings = self.alerts.check(step, {**scalars, **(feed_metrics or {})}, peak)
        metrics.update({f"data/{k}" if k in FIT_COUNTS else f"data/skipped_{k}": v for k, v in data_stats.items()})
        metrics.update(feed_metrics or {})
        metrics.update(self.constants)
        self.logger.log(step, metrics)
        for tag, image in images.items():
            self.logger.image(tag, image, step)
        return metrics

    def _memory_per_rank(self) -> dict:
        """Each rank's window figures, gathered: one curve per rank plus the largest and smallest rank."""
        local = self.memory.pop_window()
        if self.optimizer_bytes is not None:
            local["optimizer_states_gb"] = self.optimizer_bytes() / 2 ** 30
        names = list(local)
        gathered = self.env.all_gather(paddle.to_tensor([local[n] for n in names], dtype="float64"))
        table = np.stack([t.numpy() for t in gathered])  # [ranks, figures]
        out = {f"memory/rank{r}/{n}": float(table[r, i]) for r in range(len(table)) for i, n in enumerate(names)}
        peak = names.index("max_allocated_gb" if "max_allocated_gb" in names else "max_rss_gb")
        out[f"memory/max_rank_{names[peak]}"] = float(table[:, peak].max())
        out[f"memory/min_rank_{names[peak]}"] = float(table[:, peak].min())
        return out

    def log_check(self, step: int, metrics: dict) -> None:
        """Figures of a check made between logging windows (their names carry their group)."""
        self.logger.log(step, metrics)

    def log_eval(self, step: int, metrics: dict) -> None:
        self.logger.log(step, metrics, prefix="eval")

    def answers(self, step: int, groups: list[dict]) -> None:
        """A window's sampled answers (rank 0's, a few groups: ``MetricsLogger.answers``)."""
        self.logger.answers(step, groups)

    def text(self, tag: str, text: str, step: int) -> None:
        self.logger.text(tag, text, step)

    def config(self, sections: dict) -> None:
        self.logger.config(sections)

    def close(self) -> None:
        self.logger.close()


def time_breakdown(results: list) -> dict:
    """``time/<part>_s`` (mean seconds per timed step), ``time/other_s`` (what no part covers) and
    ``time/communication_share`` (collectives, gradient synchronisation and the step's reductions), over the
    steps that were timed (``timing.StepTimes.sample``)."""
    parts: dict[str, float] = {}
    timed = [result for result in results if result.times]
    for result in timed:
        for name, seconds in result.times.items():
            parts[name] = parts.get(name, 0.0) + seconds
    if not parts:
        return {}
    steps, elapsed = len(timed), sum(result.time for result in timed)
    out = {f"time/{name}_s": seconds / steps for name, seconds in sorted(parts.items())}
    out["time/other_s"] = (elapsed - sum(parts.values())) / steps
    communication = sum(seconds for name, seconds in parts.items() if name in COMMUNICATION)
    out["time/communication_share"] = communication / elapsed if elapsed else 0.0
    return out


def mtp_metrics(totals: np.ndarray) -> dict:
    """The window's multi-token prediction losses from its summed ``StepResult.mtp`` (each depth's loss sum, then its
    label count): ``mtp/depth{k}_loss`` each, and ``mtp/loss`` their mean (the loss lambda weighs)."""
    sums, counts = np.split(np.asarray(totals, dtype=np.float64), 2)
    losses = sums / np.maximum(counts, 1.0)
    return {"mtp/loss": float(losses.mean()), **{f"mtp/depth{k}_loss": float(v) for k, v in enumerate(losses, 1)}}


def progress_figures(metrics: dict) -> dict[str, str]:
    """What the progress bar shows of a window: the loss and speed, and in the GRPO stage first the reward, mean and
    spread, which its user watches."""
    # GRPO's rows carry no labels: its loss is the policy's (with the routers'), not the language model's
    loss = metrics["rl/loss"] + metrics["router_loss"] if "rl/loss" in metrics else metrics["loss"]
    shown = {"loss": f"{loss:.4f}", "tok_s": f"{metrics['tokens_per_sec']:.0f}"}
    if "rollout/reward" in metrics:
        shown = {"reward": f"{metrics['rollout/reward']:.3f}+-{metrics['rollout/reward_std']:.3f}", **shown}
    return shown
