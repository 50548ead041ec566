"""What a training step minimises: the objective, one part shared by every layout.

The model's final hidden states reach the objective through :class:`~.head.Predictions` (the head and the
cross-entropy, whole or in chunks), on one device and on a pipeline's last stage alike; the runner asks the
objective for its extra loss inputs, its figures and their metrics. An objective is a module here, not a branch
in the model, the pipeline or the runner.
"""

from __future__ import annotations

from .base import LanguageModelling, Objective
from .head import Predictions, token_losses
from .preference import PreferenceLoss, PreferenceSettings

__all__ = ["LanguageModelling", "Objective", "PreferenceLoss", "Predictions", "build_objective", "token_losses"]


def build_objective(training_cfg, env) -> Objective:
    """``training.stage``'s objective: language modelling (pretraining, SFT) or the DPO family (``dpo``), whose
    sums over the pairs of other data ranks (kto_pair) run over the data group."""
    if training_cfg.stage != "dpo":
        return LanguageModelling()
    return PreferenceLoss(PreferenceSettings.of(training_cfg), lambda x: env.all_reduce_sum(x, env.data_group))
