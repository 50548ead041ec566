"""Policy-gradient losses over sampled answers: GRPO and its family, from each answer token's log-probability.

A prompt's ``G`` answers form a group. With answer i's reward ``r_i`` and, per answer token t, the policy's
log-probability ``logp``, the sampling policy's ``old`` and the reference model's ``ref``:

- advantage ``A_i = (r_i - mean(r)) / (std(r) + 1e-6)`` over the group (std with Bessel's correction, as veRL and
  TRL take it); Dr. GRPO (Liu et al. 2025) keeps ``r_i - mean(r)``
- ratio ``rho = exp(logp - old)``; token loss ``-min(rho A, clip(rho, 1 - eps_low, 1 + eps_high) A)`` plus
  ``beta k3`` with the KL estimator ``k3 = exp(ref - logp) - (ref - logp) - 1`` (Schulman)
- ``grpo`` (Shao et al. 2024): the mean over the answer's tokens, then over the answers
- ``dr_grpo``: the sum over the answer's tokens divided by one constant (the rollout's token limit), then the mean
  over the answers
- ``dapo`` (Yu et al. 2025): the mean over every answer token of the batch (its clip-higher: ``eps_high`` above
  ``eps_low``; its dynamic sampling lives in the rollouts)
- ``gspo`` (Zheng et al. 2025): one ratio per answer, ``s_i = exp(mean_t(logp - old))``, answer loss
  ``-min(s A, clip(s, 1 - eps_low, 1 + eps_high) A)`` plus ``beta`` times the answer's mean k3; the mean over
  the answers

The sampler's and the trainer's probabilities of the same tokens differ (routing, kernels, precision): with
``w = p_trainer_old / p_sampler`` per token (``p_trainer_old``: the trainer's forward of the sampling weights), the
correction weighs each token's policy term by (detached, as veRL and ms-swift do)

- ``tis``, truncated importance sampling: ``min(w, cap)``
- ``mis``, masked importance sampling: ``w`` where ``w <= cap``, else 0 (the token left out)

at the token level, or with one weight per answer, ``exp(mean_t log w)`` (``sequence``; GSPO always). With the
correction on, the clipped ratio compares the policy with the trainer's old forward rather than the sampler.

The loss is summed here over its units (answers, or answer tokens for ``dapo``); the step divides by their count
over every micro-batch and rank (:meth:`PolicyGradient.units`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import paddle

from .. import host_reads
from ..batch import IGNORE_INDEX
from ..config.schema import TrainingConfig
from ..config.validate import mtp_trains
from .base import REFERENCE_LOGPS, Objective
from .head import Predictions

LOSSES = ("grpo", "dr_grpo", "dapo", "gspo")
CORRECTIONS = ("off", "tis", "mis")
LEVELS = ("token", "sequence")
STD_EPS = 1e-6
# the per-answer figures of a forward (summed over the answers for the metrics); a row without an answer has zeros
FIGURES = ("answers", "loss", "kl", "clipped", "tokens", "ratio", "logp", "mismatch_k3", "mismatch_past",
           "corrected")


# a sampled answer's row's inputs (data.encoding.packing.Row.inputs): its advantage, the sampling policy's
# log-probability of each label (the trainer's own forward of the sampling weights under router_replay old_policy,
# with the sampler's kept in SAMPLER_LOGPS)
ADVANTAGES, OLD_LOGPS, SAMPLER_LOGPS = "advantages", "old_logps", "sampler_logps"


@dataclass(frozen=True)
class PolicySettings:
    loss: str = "grpo"
    clip_low: float = 0.2
    clip_high: float = 0.2
    kl_beta: float = 0.0
    temperature: float = 1.0  # the rollout's: the loss reads logits / temperature, as the sampler drew from them
    max_new_tokens: int = 64  # Dr. GRPO's constant
    correction: str = "off"  # the sampler-trainer importance correction: off, tis or mis
    level: str = "token"  # its weights per token or per answer
    # the correction's cap on w; a token whose ratio passes it either way counts as a mismatch past the bound (veRL's
    # and ms-swift's default, 2)
    cap: float = 2.0
    # whether the old log-probabilities are the trainer's own forward of the sampling weights (router_replay:
    # old_policy); else they are the sampler's, and the trainer's at the sampling weights is the update's own forward
    # (exact at a rollout's first update)
    old_is_trainers: bool = False
    train_mtp: bool = False  # the model's multi-token prediction depths train on the answers beside the policy

    @classmethod
    def of(cls, training_cfg: TrainingConfig) -> PolicySettings:
        t = training_cfg
        return cls(t.rl.loss, t.rl.clip_low, t.rl.clip_high, t.rl.kl_beta, t.rl.temperature, t.rl.max_new_tokens,
                   t.rl.importance_correction, t.rl.importance_level, t.rl.importance_cap,
                   t.router_replay == "old_policy", t.rl.train_mtp and mtp_trains(t))

    @property
    def per_answer(self) -> bool:
        """Whether the loss is a mean over answers (else over answer tokens)."""
        return self.loss != "dapo"


def group_advantages(rewards: np.ndarray, group: int, scale: bool = True) -> np.ndarray:
    """Each answer's advantage from the rewards of consecutive groups of ``group`` answers (float64)."""
    r = np.asarray(rewards, np.float64).reshape([-1, group])
    centred = r - r.mean(axis=1, keepdims=True)
    if scale:
        centred = centred / (r.std(axis=1, ddof=1, keepdims=True) + STD_EPS)
    return centred.reshape(-1)


def importance_weights(log_w: paddle.Tensor, mask: paddle.Tensor, correction: str, level: str,
                       cap: float) -> tuple[paddle.Tensor, paddle.Tensor]:
    """(each token's weight, 1 where the correction capped or left it out) ``[rows, seq]``, from ``log_w``, the
    log of the trainer's probability over the sampler's per token (0 off the answer), detached."""
    if correction not in CORRECTIONS or level not in LEVELS:
        raise ValueError(f"unknown importance correction {correction!r} at level {level!r}; one of "
                         f"{', '.join(CORRECTIONS)} at {' or '.join(LEVELS)}")
    if level == "sequence":
        log_w = (log_w.sum(axis=1) / paddle.clip(mask.sum(axis=1), min=1.0))[:, None].expand_as(mask)
    w = paddle.exp(log_w)
    past = (w > cap).astype("float32") * mask
    if correction == "off":
        return mask, paddle.zeros_like(mask)
    if correction == "tis":
        return paddle.minimum(w, paddle.full_like(w, cap)) * mask, past
    return w * (1.0 - past) * mask, past


def policy_losses(settings: PolicySettings, logp: paddle.Tensor, old: paddle.Tensor, advantages: paddle.Tensor,
                  mask: paddle.Tensor, reference: paddle.Tensor | None = None,
                  sampler: paddle.Tensor | None = None) -> tuple[paddle.Tensor, dict]:
    """(the loss summed over its units, per-answer figures ``{name: [rows]}`` detached, and ``mismatch_max``,
    each answer's largest ``|log w|``) from per-token ``logp``, ``old``, ``reference``, the sampler's ``sampler``
    (``old`` where None) and ``mask`` (1 on answer tokens) ``[rows, seq]`` and ``advantages [rows]``."""
    s = settings
    if s.loss not in LOSSES:
        raise ValueError(f"unknown policy loss {s.loss!r}; one of {', '.join(LOSSES)}")
    logp, old, mask = logp.astype("float32"), old.astype("float32"), mask.astype("float32")
    sampler = old if sampler is None else sampler.astype("float32")
    tokens = mask.sum(axis=1)
    per_token = paddle.clip(tokens, min=1.0)
    a = advantages.astype("float32")[:, None]
    # the sampler-trainer gap of each token: log w, w = p_trainer / p_sampler at the sampling weights
    trainers_old = old if s.old_is_trainers else logp.detach()
    log_w = (trainers_old - sampler) * mask
    # the ratio's anchor: with a correction, the trainer's old forward (the correction weighs the gap to the sampler)
    anchor = old if s.correction == "off" else trainers_old
    level = "sequence" if s.loss == "gspo" else s.level
    weights, corrected = importance_weights(log_w, mask, s.correction, level, s.cap)
    log_ratio = (logp - anchor) * mask
    kl = paddle.zeros_like(logp)
    if reference is not None and s.kl_beta:
        gap = (reference.astype("float32") - logp) * mask
        kl = (paddle.exp(gap) - gap - 1.0) * mask
    if s.loss == "gspo":
        ratio = paddle.exp(log_ratio.sum(axis=1) / per_token)[:, None]  # one per answer, for each of its tokens
        clipped = paddle.clip(ratio, 1.0 - s.clip_low, 1.0 + s.clip_high)
        weight = weights.max(axis=1)  # the answer's one weight, on each of its tokens
        losses = -paddle.minimum(ratio * a, clipped * a)[:, 0] * weight + s.kl_beta * kl.sum(axis=1) / per_token
    else:
        ratio = paddle.exp(log_ratio)
        clipped = paddle.clip(ratio, 1.0 - s.clip_low, 1.0 + s.clip_high)
        summed = ((-paddle.minimum(ratio * a, clipped * a) * weights + s.kl_beta * kl) * mask).sum(axis=1)
        divisor = {"grpo": per_token, "dr_grpo": float(s.max_new_tokens), "dapo": 1.0}[s.loss]
        losses = summed / divisor
    answers = (tokens > 0).astype("float32")
    losses = losses * answers
    clipped_tokens = ((ratio * a > clipped * a).astype("float32") * mask).sum(axis=1)
    # the tokens past the bound either way; k3 = w - 1 - log w, through expm1: no cancellation below float32's epsilon
    past = (paddle.abs(log_w) > float(np.log(s.cap))).astype("float32") * mask
    figures = {"answers": answers, "loss": losses.detach(), "kl": kl.sum(axis=1).detach(),
               "clipped": clipped_tokens.detach(), "tokens": tokens,
               "ratio": (ratio.expand_as(mask) * mask).sum(axis=1).detach(), "logp": (logp * mask).sum(axis=1).detach(),
               "mismatch_k3": ((paddle.expm1(log_w) - log_w) * mask).sum(axis=1), "mismatch_past": past.sum(axis=1),
               "corrected": corrected.sum(axis=1), "mismatch_max": paddle.abs(log_w).max(axis=1)}
    return losses.sum(), figures


def answer_token_logps(predictions: Predictions, temperature: float) -> paddle.Tensor:
    """Each position's log-probability of its label ``[rows, seq]`` under ``logits / temperature`` (0 where the
    label is ignored). The head is linear, so the hidden states are divided instead of the logits."""
    if temperature != 1.0:
        predictions = predictions.scaled(1.0 / temperature)
    return -predictions.per_position().astype("float32")


class PolicyGradient(Objective):
    """The GRPO family's objective over a batch of sampled answers (a row each: prompt, then answer tokens with
    labels); inputs: each row's advantage, the sampling policy's token log-probabilities, and the reference's
    (``[rows, seq]``; None until its pass, and unused without ``kl_beta``), and the sampler's own (where the old ones
    are the trainer's forward)."""

    name = "rl"
    figures = FIGURES
    trains_on = "rollouts"
    input_names = (ADVANTAGES, OLD_LOGPS, REFERENCE_LOGPS, SAMPLER_LOGPS)

    def __init__(self, settings: PolicySettings):
        self.settings = settings
        self.trains_mtp = settings.train_mtp
        # the largest |log w| of the training forwards since the last logging window, on the device
        self.largest: paddle.Tensor | None = None

    # held-out data holds the samples' own answers: scored as language modelling (eval_loss, ...), and by the
    # rewards on answers generated to its prompts (training.eval_generate)
    evaluates_figures = False

    def units(self, counts) -> int:
        """The answers, or their tokens (dapo)."""
        return counts.answers if self.settings.per_answer else counts.label_tokens

    @property
    def needs_reference(self) -> bool:
        return self.settings.kl_beta > 0

    def inputs(self, batch, placeholders: bool = False) -> list:
        given = batch.objective_inputs
        reference = given.get(REFERENCE_LOGPS)
        if reference is None and placeholders:
            reference = paddle.zeros(batch.labels.shape, dtype="float32")
        sampler = given.get(SAMPLER_LOGPS)
        if sampler is None and placeholders:
            sampler = paddle.zeros(batch.labels.shape, dtype="float32")
        return [given.get(ADVANTAGES), given.get(OLD_LOGPS), reference, sampler]

    def loss(self, predictions: Predictions, labels: paddle.Tensor,
             *inputs: paddle.Tensor | None) -> tuple[paddle.Tensor, paddle.Tensor | None]:
        """(the loss summed over its units, the figures ``[rows, len(FIGURES)]``); ``inputs``: the rows'
        advantages, the sampler's and the reference's log-probabilities. A batch without advantages (held-out
        samples with their own answers) gives its summed cross-entropy and no figures."""
        advantages, old_logps, reference, sampler = inputs
        if advantages is None:
            return predictions.summed(), None
        if old_logps is None:
            raise ValueError("sampled answers carry their sampler's log-probabilities (Batch.objective_inputs)")
        logp = answer_token_logps(predictions, self.settings.temperature)
        mask = labels != IGNORE_INDEX
        total, figures = policy_losses(self.settings, logp, old_logps, advantages, mask, reference, sampler)
        largest = figures["mismatch_max"].max()
        self.largest = largest if self.largest is None else paddle.maximum(self.largest, largest)
        return total, paddle.stack([figures[name] for name in FIGURES], axis=1)

    def window_maxima(self, reduce_max: Callable[[paddle.Tensor], paddle.Tensor]) -> dict:
        """``{name}/mismatch_max_ratio``: the largest ratio either way between the trainer's and the sampler's
        probability of a token in the window's training forwards, over every rank (``reduce_max``: the maximum
        over them; every rank calls it, a pipeline's earlier stages with nothing seen)."""
        seen = paddle.zeros([], "float32") if self.largest is None else self.largest.astype("float32")
        self.largest = None
        largest = float(host_reads.read(reduce_max(seen.reshape([1])), "rollout")[0])
        return {f"{self.name}/mismatch_max_ratio": float(np.exp(largest))}

    def reference(self, predictions: Predictions, labels: paddle.Tensor,
                  *inputs: paddle.Tensor | None) -> paddle.Tensor:
        """The answer tokens' log-probabilities ``[rows, seq]`` under the reference."""
        return answer_token_logps(predictions, self.settings.temperature)

    def metrics(self, totals: np.ndarray, prefix: str) -> dict:
        """``{prefix}loss`` (per answer, or per token for dapo), ``kl`` (per token), ``clip_fraction``, the mean
        ``ratio``, ``response_length``, the answers' mean log-probability per token, the trainer's gap to the
        sampler at the sampling weights (routing, kernels, precision): ``mismatch_k3`` (per token) and
        ``mismatch_past_bound`` (the share of tokens whose probability ratio passes the correction's cap either way);
        and ``corrected``, the share the importance correction capped (tis) or left out (mis)."""
        sums = dict(zip(FIGURES, (float(v) for v in totals)))
        answers, tokens = sums["answers"], max(sums["tokens"], 1.0)
        if not answers:
            return {}
        loss = sums["loss"] / (answers if self.settings.per_answer else tokens)
        return {f"{prefix}loss": loss, f"{prefix}kl": sums["kl"] / tokens,
                f"{prefix}clip_fraction": sums["clipped"] / tokens, f"{prefix}ratio": sums["ratio"] / tokens,
                f"{prefix}response_length": sums["tokens"] / answers, f"{prefix}logp": sums["logp"] / tokens,
                f"{prefix}mismatch_k3": sums["mismatch_k3"] / tokens,
                f"{prefix}mismatch_past_bound": sums["mismatch_past"] / tokens,
                f"{prefix}corrected": sums["corrected"] / tokens}
