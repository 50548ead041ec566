"""What a run evaluates at each evaluation: the held-out set (by the objective's figures, or token scores and
caption accuracy), answers generated to its prompts (``training.eval_generate``), the benchmarks
(``training.eval_benchmarks``), and the same for the EMA's weights once it has started."""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from typing import Protocol

from ..config import Config
from ..data.encoding.packing import Row
from ..data.encoding.tokenizer import Tokenizer
from ..data.feeding.held_out_rows import held_out_batches
from ..data.feeding.loader import training_encoder
from ..objectives import Objective
from ..objectives.rewards import Reward
from ..parallel.env import DistEnv
from ..parallel.pipeline import TrainedModel
from .during_training import benchmark_metrics
from .generated import evaluate_by_generation
from .results import read_benchmarks, unknown_warnings


class HeldOutRunner(Protocol):
    """The run's runner (``training.runner``), as evaluation uses it."""

    @property
    def objective(self) -> Objective: ...

    def evaluate(self, batches: Iterable[list[Row]], training_cfg) -> dict: ...

    def eval_rows_per_device(self, training_cfg) -> int: ...


class Autocast(Protocol):
    def autocast(self) -> contextlib.AbstractContextManager: ...


class Averages(Protocol):
    @property
    def started(self) -> bool: ...

    def swapped_in(self) -> contextlib.AbstractContextManager: ...


class TrainingEvaluation:
    def __init__(self, cfg: Config, env: DistEnv, tokenizer: Tokenizer, eval_set, rewards: Sequence[Reward]):
        self.cfg, self.env, self.tokenizer, self.eval_set, self.rewards = cfg, env, tokenizer, eval_set, rewards
        self.benchmarks = read_benchmarks(cfg.training.eval_benchmarks, "training.eval_benchmarks")
        for line in unknown_warnings(self.benchmarks, tokenizer) if env.is_main else []:
            print(f"WARNING {line}", flush=True)

    def __call__(self, model: TrainedModel, runner: HeldOutRunner, precision: Autocast, ema: Averages | None) -> dict:
        """The held-out figures (``eval_*``), and the EMA's beside them (``ema_eval_*``) once it has started."""
        result = self._evaluate(model, runner, precision)
        if result and ema is not None and ema.started:
            with ema.swapped_in():
                averaged = self._evaluate(model, runner, precision, warn=False)
            result.update({f"ema_{k}": v for k, v in averaged.items() if not k.startswith("eval_skipped")})
        return result

    def _evaluate(self, model: TrainedModel, runner: HeldOutRunner, precision: Autocast, warn: bool = True) -> dict:
        cfg, t = self.cfg, self.cfg.training
        benchmarks = {}
        if self.benchmarks:
            with precision.autocast():
                benchmarks = benchmark_metrics(self.benchmarks, model, self.tokenizer, cfg.data, self.env)
        if self.eval_set is None:
            return benchmarks
        skipped: Counter = Counter()
        result = runner.evaluate(self._batches(runner, skipped), t)
        if t.eval_generate:
            with precision.autocast():
                result.update(evaluate_by_generation(model, self.eval_set,
                                                     training_encoder(self.tokenizer, cfg, Counter()),
                                                     self.tokenizer, self.env, t.eval_generate_samples,
                                                     t.eval_generate_max_new_tokens, self.rewards))
        if not result and warn and self.env.is_main:
            print(f"WARNING the held-out data gave nothing to evaluate (skipped samples: {dict(skipped) or 'none'})",
                  flush=True)
        # held-out samples skipped are reported with the figures they are missing from
        skips = {f"eval_skipped_{reason}": count for reason, count in sorted(skipped.items())}
        return {**result, **benchmarks, **skips}

    def _batches(self, runner: HeldOutRunner, skipped: Counter) -> Iterator[list[Row]]:
        return held_out_batches(self.eval_set, self.tokenizer, self.cfg, self.env,
                                runner.eval_rows_per_device(self.cfg.training), skipped,
                                runner.objective.row_inputs)
