"""The GRPO family's advantages and losses against plain NumPy versions of their formulas: values, and gradients
by central differences of the NumPy loss."""

from __future__ import annotations

import numpy as np
import paddle
import pytest

from ernie_moe.objectives.policy import LOSSES, PolicySettings, group_advantages, policy_losses


def numpy_advantages(rewards, group, scale):
    out = []
    for start in range(0, len(rewards), group):
        r = np.array(rewards[start:start + group], np.float64)
        a = r - r.mean()
        if scale:
            a = a / (np.sqrt(((r - r.mean()) ** 2).sum() / (group - 1)) + 1e-6)
        out += list(a)
    return np.array(out)


def numpy_loss(s: PolicySettings, logp, old, adv, mask, ref, weights=None):
    """The loss summed over its units, answer by answer, token by token; ``weights``: each token's importance
    weight on its policy term (1 where None)."""
    total = 0.0
    weights = np.ones_like(logp) if weights is None else weights
    for i in range(logp.shape[0]):
        t = np.flatnonzero(mask[i])
        if not len(t):
            continue
        k3 = np.exp(ref[i, t] - logp[i, t]) - (ref[i, t] - logp[i, t]) - 1.0
        if s.loss == "gspo":
            ratio = np.exp(np.mean(logp[i, t] - old[i, t]))
            surrogate = min(ratio * adv[i], np.clip(ratio, 1 - s.clip_low, 1 + s.clip_high) * adv[i])
            total += -surrogate * weights[i, t[0]] + s.kl_beta * k3.mean()
            continue
        ratio = np.exp(logp[i, t] - old[i, t])
        surrogate = np.minimum(ratio * adv[i], np.clip(ratio, 1 - s.clip_low, 1 + s.clip_high) * adv[i])
        token = -surrogate * weights[i, t] + s.kl_beta * k3
        total += {"grpo": token.mean(), "dr_grpo": token.sum() / s.max_new_tokens, "dapo": token.sum()}[s.loss]
    return total


def central_differences(loss, logp: np.ndarray, h: float = 1e-6) -> np.ndarray:
    """The gradient of ``loss(logp)`` by central differences, element by element."""
    numeric = np.zeros_like(logp)
    for index in np.ndindex(*logp.shape):
        up, down = logp.copy(), logp.copy()
        up[index] += h
        down[index] -= h
        numeric[index] = (loss(up) - loss(down)) / (2 * h)
    return numeric


@pytest.mark.parametrize("scale", [True, False])
def test_group_advantages_match_numpy(scale):
    rewards = np.random.default_rng(0).random(12)
    rewards[4:8] = 0.5  # a group whose rewards are all equal: no advantage
    got = group_advantages(rewards, 4, scale)
    np.testing.assert_allclose(got, numpy_advantages(rewards, 4, scale), rtol=1e-12)
    assert np.all(got[4:8] == 0)


@pytest.mark.parametrize("loss", LOSSES)
def test_policy_losses_and_gradients_match_numpy(loss):
    rng = np.random.default_rng(1)
    rows, seq = 5, 7
    settings = PolicySettings(loss, clip_low=0.2, clip_high=0.28, kl_beta=0.05, max_new_tokens=9)
    logp = rng.normal(-1.0, 0.3, [rows, seq])
    old = logp + rng.normal(0.0, 0.25, [rows, seq])  # far enough that some ratios are clipped
    ref = logp + rng.normal(0.0, 0.3, [rows, seq])
    adv = rng.normal(0.0, 1.0, rows)
    mask = (rng.random([rows, seq]) < 0.7).astype(np.float64)
    mask[3] = 0  # a row without an answer adds nothing
    x = paddle.to_tensor(logp.astype(np.float32), stop_gradient=False)
    total, figures = policy_losses(settings, x, paddle.to_tensor(old.astype(np.float32)),
                                   paddle.to_tensor(adv.astype(np.float32)), paddle.to_tensor(mask > 0),
                                   paddle.to_tensor(ref.astype(np.float32)))
    total.backward()
    np.testing.assert_allclose(float(total), numpy_loss(settings, logp, old, adv, mask, ref), rtol=1e-5, atol=1e-6)
    numeric = central_differences(lambda at: numpy_loss(settings, at, old, adv, mask, ref), logp)
    np.testing.assert_allclose(x.grad.numpy(), numeric, rtol=1e-3, atol=1e-5)
    assert figures["answers"].numpy().tolist() == [1, 1, 1, 0, 1]
    np.testing.assert_allclose(figures["tokens"].numpy(), mask.sum(axis=1))
    if loss != "gspo":  # with these ratios the clip is reached somewhere, and the count is the NumPy one
        ratio = np.exp(logp - old)
        clipped = (ratio * adv[:, None] > np.clip(ratio, 0.8, 1.28) * adv[:, None]) & (mask > 0)
        assert clipped.sum() > 0
        np.testing.assert_allclose(figures["clipped"].numpy(), clipped.sum(axis=1))
    gap = (logp - old) * mask  # the sampler-trainer mismatch, token by token, whatever the loss
    np.testing.assert_allclose(figures["mismatch_k3"].numpy(), ((np.exp(gap) - gap - 1) * mask).sum(axis=1),
                               rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(figures["mismatch_past"].numpy(), ((np.abs(gap) > np.log(2.0)) & (mask > 0)).sum(1))


def test_unchanged_policy_gives_ratio_one_and_the_mean_advantage():
    """At the first update (logp == old, no KL) each answer's loss is -A, whatever the clip range."""
    logp = paddle.to_tensor(np.full([3, 4], -2.0, np.float32))
    adv = paddle.to_tensor(np.array([1.0, -0.5, 2.0], np.float32))
    mask = paddle.to_tensor(np.ones([3, 4], bool))
    for loss in LOSSES:
        total, figures = policy_losses(PolicySettings(loss, max_new_tokens=4), logp, logp, adv, mask)
        units = 12 if loss == "dapo" else 3
        assert float(total) / units == pytest.approx(-2.5 / 3, rel=1e-6)
        np.testing.assert_allclose(figures["ratio"].numpy(), [4, 4, 4])
        assert float(figures["clipped"].sum()) == 0


def numpy_weights(correction, level, cap, trainers, sampler, mask):
    """Each token's importance weight: w = p_trainer / p_sampler, per token or the answer's geometric mean, then
    truncated at the cap (tis) or zero past it (mis)."""
    weights = np.zeros_like(trainers)
    for i in range(trainers.shape[0]):
        t = np.flatnonzero(mask[i])
        if not len(t):
            continue
        log_w = trainers[i, t] - sampler[i, t]
        w = np.exp(np.full(len(t), log_w.mean()) if level == "sequence" else log_w)
        weights[i, t] = np.minimum(w, cap) if correction == "tis" else np.where(w <= cap, w, 0.0)
    return weights


@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("correction", ["tis", "mis"])
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("old_is_trainers", [False, True])
def test_importance_corrections_and_their_gradients_match_numpy(loss, correction, level, old_is_trainers):
    """TIS and MIS weigh each token's policy term by the trainer's probability over the sampler's (capped, or left
    out past the cap), detached: the loss and its gradient against NumPy. The trainer's probabilities at the
    sampling weights are the old ones where the trainer computed them (router_replay old_policy), else the update's
    own forward, the ratio then 1 in value; the mismatch figures measure the trainer against the sampler."""
    rng = np.random.default_rng(2)
    rows, seq, cap = 6, 7, 1.5
    settings = PolicySettings(loss, clip_low=0.2, clip_high=0.28, kl_beta=0.05, max_new_tokens=9,
                              correction=correction, level=level, cap=cap, old_is_trainers=old_is_trainers)
    logp = rng.normal(-1.0, 0.3, [rows, seq])
    old = logp + rng.normal(0.0, 0.1, [rows, seq])  # the trainer's forward of the sampling weights
    sampler = (old if old_is_trainers else logp) + rng.normal(0.0, 0.5, [rows, seq])  # past the cap somewhere
    sampler[4] = (old if old_is_trainers else logp)[4] - 2.0  # an answer the trainer finds far likelier: w = e^2
    ref = logp + rng.normal(0.0, 0.3, [rows, seq])
    adv = rng.normal(0.0, 1.0, rows)
    mask = (rng.random([rows, seq]) < 0.7).astype(np.float64)
    mask[3] = 0
    mask[4, :3] = 1
    trainers = old if old_is_trainers else logp  # held fixed under the central differences: detached
    weights = numpy_weights(correction, "sequence" if loss == "gspo" else level, cap, trainers, sampler, mask)
    x = paddle.to_tensor(logp.astype(np.float32), stop_gradient=False)
    f32 = lambda a: paddle.to_tensor(a.astype(np.float32))  # noqa: E731
    total, figures = policy_losses(settings, x, f32(old if old_is_trainers else sampler), f32(adv),
                                   paddle.to_tensor(mask > 0), f32(ref), f32(sampler))
    total.backward()
    expected = numpy_loss(settings, logp, trainers, adv, mask, ref, weights)
    np.testing.assert_allclose(float(total), expected, rtol=1e-5, atol=1e-6)
    numeric = central_differences(lambda at: numpy_loss(settings, at, trainers, adv, mask, ref, weights), logp)
    np.testing.assert_allclose(x.grad.numpy(), numeric, rtol=1e-3, atol=1e-5)
    uncorrected = numpy_loss(settings, logp, trainers, adv, mask, ref)
    assert abs(expected - uncorrected) > 1e-3  # the weights changed the loss
    # the mismatch: trainer against sampler, per token, whatever the correction
    gap = (trainers - sampler) * mask
    np.testing.assert_allclose(figures["mismatch_k3"].numpy(), ((np.exp(gap) - gap - 1) * mask).sum(axis=1),
                               rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(figures["mismatch_past"].numpy(), ((np.abs(gap) > np.log(cap)) & (mask > 0)).sum(1))
    np.testing.assert_allclose(figures["mismatch_max"].numpy(), np.abs(gap).max(axis=1), rtol=1e-5)
    # the tokens the correction capped or left out: those whose w (at the correction's level) passes the cap
    past_cap = numpy_weights("tis", "sequence" if loss == "gspo" else level, np.inf, trainers, sampler, mask) > cap
    assert past_cap.sum() > 0
    np.testing.assert_allclose(figures["corrected"].numpy(), past_cap.sum(axis=1))
