"""What a training step minimises: the objective, one part shared by every layout.

The model's final hidden states reach the objective through :class:`~.head.Predictions` (the head and the
cross-entropy, whole or in chunks), on one device and on a pipeline's last stage alike; the runner asks the
objective for its extra loss inputs, its figures and their metrics. An objective is a module here, registered by
name (``training.stage``), not a branch in the model, the pipeline or the runner.
"""

from __future__ import annotations

from .base import LanguageModelling, Objective
from .head import Predictions, token_losses
from .policy import PolicyGradient, PolicySettings
from .preference import PreferenceLoss
from .registry import build_objective, register

__all__ = ["LanguageModelling", "Objective", "PolicyGradient", "PreferenceLoss", "Predictions", "build_objective",
           "register", "token_losses"]

# language modelling (pretraining, SFT); the DPO family, whose sums over the pairs of other data ranks (kto_pair)
# run over the data group; the GRPO family
register("sft", lambda t, reduce_sum: LanguageModelling())
register("dpo", lambda t, reduce_sum: PreferenceLoss(t.dpo, reduce_sum))
register("grpo", lambda t, reduce_sum: PolicyGradient(PolicySettings.of(t)))
