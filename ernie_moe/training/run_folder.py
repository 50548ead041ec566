"""What a run writes into its output folder besides checkpoints and metrics: ``run_config.yaml`` when it starts,
``summary.json`` when it ends, and under the elastic launcher the job's record of this attempt
(``attempts.jsonl``: where it started, and how it ended). Rank 0 writes; the other ranks keep the attempt's
figures too."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import yaml

from .. import json_files
from ..config import Config
from ..elastic.job import Attempt, JobRecord, restart_history
from ..parallel.env import DistEnv
from ..parallel.global_batch import global_batch
from ..paths import write_output

# what a run writes into its output folder beside checkpoints and models (each a regular file or absent)
RUN_FILES = ("metrics.jsonl", "rollouts.jsonl", "summary.json", "run_config.yaml", "data_report.json",
             "import_report.json", "attempts.jsonl")


class RunFolder:
    def __init__(self, cfg: Config, env: DistEnv, job: JobRecord | None):
        self.cfg, self.env, self.job = cfg, env, job
        self.out = Path(cfg.training.output_dir)
        self.attempt: Attempt | None = None
        self.restarts: list[dict] = []  # the job's restarts so far, each with its why

    def begin_attempt(self, earlier: list[Attempt], step: int, run_id: str) -> None:
        """Record this start of the elastic job and say, on a restart, where it resumed and why."""
        if self.job is None:
            return
        self.attempt = Attempt(len(earlier), self.env.world_size, global_batch(self.cfg, self.env.world_size), step,
                               run_id)
        self.restarts = restart_history([*earlier, self.attempt])
        if not self.env.is_main:
            return
        self.job.begin(self.attempt)
        if earlier:
            print(f"restart {len(earlier)} of job {self.job.job}: step {step} on {self.env.world_size} process(es), a "
                  f"global batch of {self.attempt.global_batch} rows in "
                  f"{self.cfg.training.gradient_accumulation_steps} accumulation step(s); {self.restarts[-1]['why']}",
                  flush=True)

    def write_config(self) -> dict:
        """``run_config.yaml``: the config the run trains with; its sections, for the dashboard."""
        sections = dataclasses.asdict(self.cfg)
        if self.env.is_main:
            self.out.mkdir(parents=True, exist_ok=True)
            write_output(self.out / "run_config.yaml", yaml.safe_dump(sections, sort_keys=False))
        return sections

    def write_summary(self, summary: dict) -> None:
        """``summary.json`` (with the job's restarts under the elastic launcher), and the attempt's end."""
        if not self.env.is_main:
            return
        if self.job is not None and self.attempt is not None:
            summary = {**summary, "job": self.job.job, "restarts": len(self.restarts),
                       "restart_history": self.restarts}
            self.job.end(self.attempt, summary["status"], summary["steps"], summary.get("reason", ""))
        write_output(self.out / "summary.json", json_files.dumps(summary, indent=2))
