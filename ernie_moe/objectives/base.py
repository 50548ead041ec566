"""The objective's interface, and language modelling: the summed cross-entropy of the label tokens."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import paddle

from ..config.schema import ModelConfig
from .head import Predictions

# the input a reference pass fills (``Objective.reference``): what it kept of each row
REFERENCE_LOGPS = "reference_logps"


class Objective:
    """What a batch's loss is, given the model's predictions.

    ``figures`` names per-row figures the loss returns beside it (``[rows, len(figures)]``, detached): the step
    sums them over its rows, the runner evaluates held-out data by them, and :meth:`metrics` turns their sums
    into the logged means. An objective without figures is evaluated by its token scores (``evaluation.token_scores``).
    """

    name = "lm"  # the metrics' prefix in training (``{name}/...``)
    figures: tuple[str, ...] = ()
    trains_mtp = False  # whether the model's multi-token prediction layers train beside it (model.mtp)
    # the data it trains on: "rows" (packed samples), "pairs" (preference pairs, one a row) or "rollouts" (answers
    # sampled from the policy as it trains)
    trains_on = "rows"

    input_names: tuple[str, ...] = ()  # the batch's fields the loss reads besides its labels

    @property
    def needs_reference(self) -> bool:
        """Whether a reference pass fills each batch's reference figures before the step."""
        return False

    @property
    def reference_source(self) -> str | None:
        """Where its reference figures come from: "model" (the starting weights' pass each step), "precomputed"
        (computed once before the run), or None (it needs none)."""
        return "model" if self.needs_reference else None

    def mtp_depths(self, model_cfg: ModelConfig) -> int:
        """The multi-token prediction depths that train beside this objective (0: the model has none, or the
        objective leaves them as they are, as preference and RL losses do)."""
        return model_cfg.num_nextn_predict_layers if self.trains_mtp else 0

    @property
    def evaluates_figures(self) -> bool:
        """Whether held-out data is evaluated by the figures (else by its token scores)."""
        return bool(self.figures)

    def units(self, counts) -> int:
        """What the loss is a mean over, counted in a micro-batch's ``batch.HostCounts``: its label tokens."""
        return counts.label_tokens

    def row_inputs(self, row) -> dict[str, np.ndarray]:
        """The inputs a row of packed samples or pairs carries for this objective (``data.encoding.packing.Row``),
        made from the row as it is read, training and held out; ``collate`` stacks them over a batch's rows into
        ``Batch.objective_inputs``. The package's objectives have theirs written where their rows are made (a
        pair's sides by the pair encoder, a sampled answer's by the rollouts)."""
        return {}

    def inputs(self, batch, placeholders: bool = False) -> list[paddle.Tensor | None]:
        """The loss's inputs of ``batch`` (:attr:`input_names`); ``placeholders``: a tensor of the right shape
        for one not filled yet (a pipeline carries tensors only, with the labels)."""
        return [batch.objective_inputs.get(name) for name in self.input_names]

    def loss(self, predictions: Predictions, labels: paddle.Tensor,
             *inputs: paddle.Tensor | None) -> tuple[paddle.Tensor, paddle.Tensor | None]:
        """(the loss summed over its units: label tokens, pairs, ..., the figures of each row or None)."""
        raise NotImplementedError

    def reference(self, predictions: Predictions, labels: paddle.Tensor,
                  *inputs: paddle.Tensor | None) -> paddle.Tensor:
        """What a reference pass keeps of each row (for DPO the answers' log-probabilities), computed without the
        reference's own inputs, which it is about to fill (``needs_reference``)."""
        raise NotImplementedError(f"the {self.name} objective has no reference pass")

    def metrics(self, totals: np.ndarray, prefix: str) -> dict:
        """The figures summed over rows (and ranks) -> the metrics logged as ``{prefix}...``."""
        return {}

    def window_maxima(self, reduce_max: Callable[[paddle.Tensor], paddle.Tensor]) -> dict:
        """The metrics that are maxima over the logging window's training forwards (every rank calls this at a
        window's end; ``reduce_max``: the maximum over the ranks)."""
        return {}


class LanguageModelling(Objective):
    trains_mtp = True

    def loss(self, predictions: Predictions, labels: paddle.Tensor, *inputs: paddle.Tensor | None):
        return predictions.summed(), None
