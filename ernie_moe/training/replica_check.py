"""The run's replica check (``training.replica_check``): at the start, after a resume and every
``training.replica_check_steps``, the weights that data-parallel and expert replicas should hold equal are
compared (``parallel.replicas``); a mismatch names the parameters and ranks, and the trainer stops the run (or
warns)."""

from __future__ import annotations

import paddle

from ..config.schema import TrainingConfig
from ..parallel.env import DistEnv
from ..parallel.pipeline import TrainedModel
from ..parallel.replicas import compare_replicas, describe, replica_sets


class ReplicasDiffer(RuntimeError):
    """Ranks that should hold the same weights do not."""


class ReplicaCheck:
    def __init__(self, training_cfg: TrainingConfig, env: DistEnv, model: TrainedModel):
        self.action, self.every = training_cfg.replica_check, training_cfg.replica_check_steps
        self.env = env
        named = model.stable_named_parameters(include_tied_copy=True)
        self.sets = replica_sets(named, env) if self.action != "off" else []
        # every rank must agree on whether there is anything to compare: the comparison is a collective
        self.enabled = any(env.all_gather_object(bool(self.sets)))

    def due(self, step: int) -> bool:
        return self.enabled and self.every > 0 and step % self.every == 0

    def run(self, when: str) -> tuple[dict, str | None]:
        """Compare the replicas now (every rank calls this): the metrics to log, and what differs (None when
        nothing does)."""
        differences = compare_replicas(self.sets, self.env)
        metrics = {"replicas/max_abs_diff": max((d.max_abs_diff for d in differences), default=0.0),
                   "replicas/differing_copies": len(differences)}
        if not differences:
            return metrics, None
        return metrics, (f"replicas that should hold the same weights differ {when}: {describe(differences)}. Look "
                         "for a non-deterministic kernel, a gradient that skipped its all-reduce, or a checkpoint "
                         "that loaded differently on some ranks")

    @paddle.no_grad()
    def perturb(self) -> None:
        """The fault ``perturb_weight`` (``faults``): the first element of the first replicated parameter moves."""
        if self.sets:
            _, param = self.sets[0].named[0]
            flat = param.flatten()
            flat[0] = flat[0] + 1e-3
            param.set_value(flat.reshape(param.shape))
