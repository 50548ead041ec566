"""Preference losses over answer pairs: DPO and its family, from the sequence log-probabilities of each pair.

Each loss takes, per pair, the policy's summed log-probabilities of the chosen and the rejected answer
(``policy [pairs, 2]``), the reference model's (``reference``, None for the reference-free SimPO) and the answers'
trained token counts (``lengths``). With ``h = (log pi_c - log pi_r) - (log ref_c - log ref_r)``:

- ``sigmoid`` (DPO, Rafailov et al. 2023; label smoothing as in cDPO): ``-(1-e) log s(b h) - e log s(-b h)``
- ``ipo`` (Azar et al. 2023): ``(h - 1 / (2 b))^2``
- ``dpop`` (DPO-Positive, Pal et al. 2024): DPO's with ``h - lambda max(0, log ref_c - log pi_c)``
- ``kto_pair`` (Ethayarajh et al. 2024, paired form): ``(1 - s(b (r_c - z_r)) + 1 - s(b (z_c - r_r))) / 2`` with
  ``r = log pi - log ref`` per answer and ``z = max(0, mean r)`` over the pairs of the global micro-batch, held
  constant (the paper does not back-propagate through its KL estimate)
- ``simpo`` (Meng et al. 2024, reference-free): ``-(1-e) log s(g) - e log s(-g)``, ``g = b (log pi_c / |c| -
  log pi_r / |r|) - gamma``

``normalize_length`` divides every log-probability by its answer's token count first (SimPO always does).
``sft_weight`` adds that multiple of the chosen answer's mean token cross-entropy. Rewards are ``b (log pi -
log ref)`` per answer (SimPO: ``b log pi / |answer|``), detached.
"""

from __future__ import annotations

import numpy as np
import paddle
import paddle.nn.functional as F

from ..batch import CHOSEN, IGNORE_INDEX, PAIR_SIDES, REJECTED
from ..config.schema import PreferenceConfig
from .base import REFERENCE_LOGPS, Objective
from .head import Predictions

LOSSES = ("sigmoid", "ipo", "simpo", "kto_pair", "dpop")
# the per-pair figures of a forward, in this order (summed over the pairs for the metrics); a row that holds no
# pair (a filler row of a short evaluation batch) has zeros
FIGURES = ("pairs", "loss", "logps_chosen", "logps_rejected", "rewards_chosen", "rewards_rejected", "accurate",
           "tokens_chosen", "tokens_rejected")
LOGPS = slice(2, 4)  # the columns of the two answers' log-probabilities


def needs_reference(settings: PreferenceConfig) -> bool:
    """Whether the loss compares with a reference model (SimPO needs none)."""
    return settings.loss != "simpo"


def _smoothed(logits: paddle.Tensor, smoothing: float) -> paddle.Tensor:
    return -(1.0 - smoothing) * F.log_sigmoid(logits) - smoothing * F.log_sigmoid(-logits)


def answer_logps(token_losses: paddle.Tensor, labels: paddle.Tensor, sides: paddle.Tensor):
    """(summed log-probabilities ``[rows, 2]``, trained tokens ``[rows, 2]``) of each row's chosen and rejected
    answer, from the token cross-entropies ``[rows, seq]`` (0 where the label is IGNORE_INDEX)."""
    trained = labels != IGNORE_INDEX
    masks = [paddle.logical_and(trained, sides == side).astype("float32") for side in (CHOSEN, REJECTED)]
    logps = paddle.stack([-(token_losses.astype("float32") * m).sum(axis=1) for m in masks], axis=1)
    return logps, paddle.stack([m.sum(axis=1) for m in masks], axis=1)


def pair_figures(settings: PreferenceConfig, policy: paddle.Tensor, lengths: paddle.Tensor,
                 reference: paddle.Tensor | None, reduce_sum=None) -> tuple[paddle.Tensor, paddle.Tensor]:
    """(summed loss over the pairs, the figures ``[rows, len(FIGURES)]`` detached) of a forward. Without
    ``reference`` where the loss needs one (the reference model's own pass) the loss and rewards are 0."""
    valid = paddle.logical_and(lengths[:, 0] > 0, lengths[:, 1] > 0).astype("float32")
    if reference is None and needs_reference(settings):
        losses, rewards = paddle.zeros_like(valid), paddle.zeros_like(policy)
    else:
        losses, rewards = pair_losses(settings, policy, reference, lengths, valid, reduce_sum)
    losses = losses * valid
    accurate = (rewards[:, 0] > rewards[:, 1]).astype("float32")
    figures = paddle.concat([valid[:, None], losses.detach()[:, None], policy.detach(), rewards, accurate[:, None],
                             lengths], axis=1)
    return losses.sum(), figures * valid[:, None]


def pair_losses(settings: PreferenceConfig, policy: paddle.Tensor, reference: paddle.Tensor | None,
                lengths: paddle.Tensor, valid: paddle.Tensor | None = None,
                reduce_sum=None) -> tuple[paddle.Tensor, paddle.Tensor]:
    """(losses ``[pairs]``, rewards ``[pairs, 2]`` detached). ``valid``: 1 for the rows that hold a pair (None:
    all); ``reduce_sum`` sums a tensor over the ranks holding the global micro-batch's other pairs (kto_pair's
    KL estimate), None on one rank."""
    s, b = settings, settings.beta
    policy = policy.astype("float32")
    valid = paddle.ones([policy.shape[0]], dtype="float32") if valid is None else valid
    lengths = paddle.clip(lengths.astype("float32"), min=1.0)
    normalized = policy / lengths
    if s.loss == "simpo":
        scaled = b * normalized
        losses = _smoothed(scaled[:, 0] - scaled[:, 1] - s.simpo_gamma, s.label_smoothing)
        rewards = scaled.detach()
    else:
        if reference is None:
            raise ValueError(f"training.dpo.loss {s.loss} needs the reference model's log-probabilities")
        reference = reference.astype("float32")
        if s.normalize_length:
            policy, reference = normalized, reference / lengths
        ratios = policy - reference  # log pi - log ref per answer
        h = ratios[:, 0] - ratios[:, 1]
        if s.loss == "sigmoid":
            losses = _smoothed(b * h, s.label_smoothing)
        elif s.loss == "ipo":
            losses = (h - 1.0 / (2.0 * b)) ** 2
        elif s.loss == "dpop":
            penalty = paddle.clip(reference[:, 0] - policy[:, 0], min=0.0)
            losses = _smoothed(b * (h - s.dpop_lambda * penalty), s.label_smoothing)
        elif s.loss == "kto_pair":
            kl = _mean_over_pairs(ratios.detach(), valid, reduce_sum)
            kl = paddle.clip(kl, min=0.0)
            losses = (2.0 - F.sigmoid(b * (ratios[:, 0] - kl[1])) - F.sigmoid(b * (kl[0] - ratios[:, 1]))) / 2.0
        else:
            raise ValueError(f"unknown preference loss {s.loss!r}; one of {', '.join(LOSSES)}")
        rewards = (b * ratios).detach()
    if s.sft_weight:
        losses = losses - s.sft_weight * normalized[:, 0]
    return losses, rewards


def _mean_over_pairs(ratios: paddle.Tensor, valid: paddle.Tensor, reduce_sum) -> paddle.Tensor:
    """``[2]``: the mean log-ratio of the chosen and of the rejected answers over the global micro-batch."""
    totals = paddle.concat([(ratios * valid[:, None]).sum(axis=0), valid.sum().reshape([1])])
    if reduce_sum is not None:
        totals = reduce_sum(totals)
    return totals[:2] / paddle.clip(totals[2], min=1.0)


class PreferenceLoss(Objective):
    """The DPO family's objective over a batch of pairs (a row each): the loss of each pair from its answers'
    log-probabilities, in place of the summed LM loss; its figures are :data:`FIGURES`. ``reduce_sum``: as in
    :func:`pair_losses`."""

    name = "dpo"
    figures = FIGURES
    trains_on = "pairs"

    def __init__(self, settings: PreferenceConfig, reduce_sum=None):
        self.settings, self.reduce_sum = settings, reduce_sum

    @property
    def needs_reference(self) -> bool:
        return needs_reference(self.settings)

    @property
    def reference_source(self) -> str | None:
        return self.settings.reference if self.needs_reference else None

    input_names = (PAIR_SIDES, REFERENCE_LOGPS)  # the reference's log-probabilities: None before its pass

    def units(self, counts) -> int:
        """The pairs."""
        return counts.pairs

    def inputs(self, batch, placeholders: bool = False) -> list:
        sides, reference = batch.objective_inputs.get(PAIR_SIDES), batch.objective_inputs.get(REFERENCE_LOGPS)
        if reference is None and placeholders:
            reference = paddle.zeros([batch.labels.shape[0], 2], dtype="float32")
        return [sides, reference]

    def loss(self, predictions: Predictions, labels: paddle.Tensor,
             *inputs: paddle.Tensor | None) -> tuple[paddle.Tensor, paddle.Tensor]:
        """(summed loss over the pairs, the figures ``[rows, len(FIGURES)]``); ``inputs``: the rows' pair sides,
        the reference's log-probabilities (None in the reference's own pass)."""
        sides, reference = inputs
        if sides is None:
            raise ValueError("a preference batch carries its rows' pair sides (Batch.objective_inputs)")
        policy, lengths = answer_logps(predictions.per_position(), labels, sides)
        return pair_figures(self.settings, policy, lengths, reference, self.reduce_sum)

    def reference(self, predictions: Predictions, labels: paddle.Tensor,
                  *inputs: paddle.Tensor | None) -> paddle.Tensor:
        """The answers' log-probabilities ``[rows, 2]`` (0 in a row without a pair)."""
        return self.loss(predictions, labels, inputs[0], None)[1][:, LOGPS]

    def metrics(self, totals: np.ndarray, prefix: str) -> dict:
        return preference_metrics(totals, prefix)


def preference_metrics(totals: np.ndarray, prefix: str) -> dict:
    """The figures of :data:`FIGURES` summed over pairs -> their means (``{prefix}loss``, ``{prefix}rewards_chosen``,
    ..., ``{prefix}reward_margin``, ``{prefix}reward_accuracy``); empty without pairs."""
    pairs = float(totals[0])
    if not pairs:
        return {}
    mean = dict(zip(FIGURES, (float(v) / pairs for v in totals)))
    return {f"{prefix}loss": mean["loss"], f"{prefix}rewards_chosen": mean["rewards_chosen"],
            f"{prefix}rewards_rejected": mean["rewards_rejected"],
            f"{prefix}reward_margin": mean["rewards_chosen"] - mean["rewards_rejected"],
            f"{prefix}reward_accuracy": mean["accurate"], f"{prefix}logps_chosen": mean["logps_chosen"],
            f"{prefix}logps_rejected": mean["logps_rejected"]}
