"""What a training step minimises: the objective, one part shared by every layout.

The model's final hidden states reach the objective through :class:`~.head.Predictions` (the head and the
cross-entropy, whole or in chunks), on one device and on a pipeline's last stage alike; the runner asks the
objective for its extra loss inputs, its figures and their metrics. An objective is a module here, not a branch
in the model, the pipeline or the runner.
"""

from __future__ import annotations

from ..config.schema import TrainingConfig
from .base import LanguageModelling, Objective
from .head import Predictions, token_losses
from .policy import PolicyGradient, PolicySettings
from .preference import PreferenceLoss, PreferenceSettings

__all__ = ["LanguageModelling", "Objective", "PolicyGradient", "PreferenceLoss", "Predictions", "build_objective",
           "token_losses"]


def build_objective(training_cfg: TrainingConfig, env=None) -> Objective:
    """``training.stage``'s objective: language modelling (pretraining, SFT), the DPO family (``dpo``), whose
    sums over the pairs of other data ranks (kto_pair) run over the data group, or the GRPO family (``grpo``).
    ``env``: None where the objective is read for its rules (the memory planner), not run."""
    if training_cfg.stage == "grpo":
        return PolicyGradient(PolicySettings.of(training_cfg))
    if training_cfg.stage != "dpo":
        return LanguageModelling()
    reduce_sum = None if env is None else (lambda x: env.all_reduce_sum(x, env.data_group))
    return PreferenceLoss(PreferenceSettings.of(training_cfg), reduce_sum)
