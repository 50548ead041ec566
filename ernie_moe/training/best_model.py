"""The best evaluation so far (``training.save_best_metric``) and early stopping (``early_stopping_patience``).

An evaluation that improves the metric writes ``output_dir/best_model`` (a model folder like ``final_model``,
with ``best.json``: the metric, its value and the step). The new best is written beside the old one
(``best_model.tmp``) and swapped in, so a run that dies while writing it leaves the old best whole. A resumed
run reads ``best.json`` back, so the best and the evaluations since it carry over.
"""

from __future__ import annotations

import math
import shutil
from collections.abc import Callable
from pathlib import Path

from ..config import ConfigError
from ..config.schema import TrainingConfig
from ..json_files import UnreadableJSON, dumps, read_json
from ..parallel.env import DistEnv

BEST_DIR, BEST_FILE = "best_model", "best.json"


class BestModel:
    def __init__(self, training_cfg: TrainingConfig, resumed: bool):
        t = training_cfg
        self.metric, self.patience = t.save_best_metric, t.early_stopping_patience
        self.lower_is_better = self.metric.endswith("loss")
        self.folder = Path(t.output_dir) / BEST_DIR
        self.value: float | None = None
        self.step: int | None = None
        self.since = 0  # evaluations since the best
        self.writing, self.previous = (self.folder.with_name(f"{BEST_DIR}.{end}") for end in ("tmp", "old"))
        if self.metric and resumed:
            if not self.folder.exists() and self.previous.is_dir():  # died between the swap's two renames
                self.previous.rename(self.folder)
            self._read()

    def update(self, step: int, metrics: dict) -> bool:
        """Whether this evaluation is the new best (its model is then to be written)."""
        if not self.metric or not metrics:
            return False
        if self.metric not in metrics:
            skipped = {k.rsplit("/skipped_", 1)[1]: v for k, v in metrics.items()
                       if k.startswith(self.metric + "/skipped_")}
            if skipped:  # a benchmark of which nothing could be asked: no typo
                raise ConfigError(f"training.save_best_metric {self.metric!r}: the benchmark had no question it "
                                  f"could ask at this evaluation (skipped: {skipped})")
            known = ", ".join(sorted(k for k in metrics if not k.startswith("eval_skipped")))
            raise ConfigError(f"training.save_best_metric {self.metric!r} is not among this run's evaluation "
                              f"figures ({known})")
        value = float(metrics[self.metric])
        better = math.isfinite(value) and (self.value is None or (
            value < self.value if self.lower_is_better else value > self.value))
        if better:
            self.value, self.step, self.since = value, step, 0
        else:
            self.since += 1
        return better

    @property
    def patience_spent(self) -> bool:
        return bool(self.patience) and self.since >= self.patience

    def record(self) -> dict:
        return {"metric": self.metric, "value": self.value, "step": self.step, "evaluations_since": self.since}

    def replace(self, export: Callable[[Path], object], env: DistEnv) -> None:
        """The new best written by ``export`` (every rank's part) into ``best_model.tmp``, then swapped in."""
        if env.is_main:
            shutil.rmtree(self.writing, ignore_errors=True)
        env.all_gather_object(None)  # every rank writes into the fresh folder
        export(self.writing)
        env.all_gather_object(None)  # ... and has written
        if env.is_main:
            shutil.rmtree(self.previous, ignore_errors=True)
            if self.folder.exists():
                self.folder.rename(self.previous)
            self.writing.rename(self.folder)
            shutil.rmtree(self.previous, ignore_errors=True)
        env.all_gather_object(None)

    def write_record(self) -> None:
        (self.folder / BEST_FILE).write_text(dumps(self.record(), indent=2))

    def summary(self) -> dict:
        if not self.metric or self.step is None:
            return {}
        return {"best_metric": self.metric, "best_value": self.value, "best_step": self.step,
                "best_model_dir": str(self.folder)}

    def _read(self) -> None:
        path = self.folder / BEST_FILE
        if not path.is_file():
            return
        try:
            record = read_json(path, max_bytes=1 << 16)
        except UnreadableJSON as err:
            raise ConfigError(f"{path}: {err}; remove best_model to start the best over") from None
        if not isinstance(record, dict) or record.get("metric") != self.metric:
            return  # another metric's best: this run's starts afresh
        value, step, since = record.get("value"), record.get("step"), record.get("evaluations_since", 0)
        if isinstance(value, (int, float)) and isinstance(step, int) and isinstance(since, int):
            self.value, self.step, self.since = float(value), step, since
